import os, signal, socket, subprocess, sys, time, json, torch
PY = sys.argv[1]
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
lp = port()
lh = subprocess.Popen([os.path.join(os.path.dirname(PY), "torchft_lighthouse"), "--bind", f"127.0.0.1:{lp}", "--min_replicas", "1", "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"], stdout=open("/tmp/spike/lh.log", "w"), stderr=subprocess.STDOUT)
STOP = 80
def start_group(g, tag):
    mp = port(); procs = []
    for r in range(2):
        env = dict(os.environ, REPLICA_GROUP_ID=str(g), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(mp), TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lp}", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([PY, "/tmp/spike/hsdp_worker.py", f"/tmp/spike/{tag}_r{r}", "/tmp/spike/stop"], env=env, stdout=open(f"/tmp/spike/{tag}_r{r}.log", "w"), stderr=subprocess.STDOUT))
    return procs
def last(tag):
    try: return json.loads(open(f"/tmp/spike/{tag}.jsonl").read().splitlines()[-1])
    except Exception: return None
if os.path.exists("/tmp/spike/stop"): os.remove("/tmp/spike/stop")
for f in os.listdir("/tmp/spike"):
    if f.endswith((".jsonl", ".pt")): os.remove(f"/tmp/spike/{f}")
g0 = start_group(0, "g0"); g1 = start_group(1, "g1")
t0 = time.time()
while True:
    a = last("g1_r0")
    if a and a["step"] >= 15 and a["n"] == 2: break
    if time.time() - t0 > 240: print("timeout start"); break
    time.sleep(0.2)
print("g1 at", a, "g0 at", last("g0_r0"))
os.kill(g1[1].pid, signal.SIGKILL)
print("killed g1 r1")
os.kill(g1[0].pid, signal.SIGKILL); g1[0].wait(); g1[1].wait()
s0 = last("g0_r0")["step"]; time.sleep(5); print("g0 progressed", s0, "->", last("g0_r0")["step"])
g1b = start_group(1, "g1b")
t0 = time.time()
while True:
    a = last("g1b_r0")
    if a and a["n"] == 2: break
    if time.time() - t0 > 240: print("timeout rejoin"); break
    time.sleep(0.2)
print("rejoined at", a)
open("/tmp/spike/stop", "w").write(str(a["step"] + 10))
for p in g0 + g1b: print("exit", p.wait(300))
lh.terminate(); lh.wait()
for r in range(2):
    a = torch.load(f"/tmp/spike/g0_r{r}.pt"); b = torch.load(f"/tmp/spike/g1b_r{r}.pt")
    print("rank", r, "identical:", all(torch.equal(a[k], b[k]) for k in a))
print("g1b first", open("/tmp/spike/g1b_r0.jsonl").readline())
