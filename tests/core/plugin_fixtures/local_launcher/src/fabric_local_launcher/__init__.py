"""A script launcher of a third party: ``fabric run --launcher local_procs`` starts every process on this machine."""
