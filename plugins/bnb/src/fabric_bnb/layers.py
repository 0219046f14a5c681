"""bitsandbytes' linear layers, made to quantize as they are built and to load their own checkpoints.

bitsandbytes quantizes a layer when it is moved to a device and saves the quantized state, but a fresh layer
cannot load that state back (4-bit: "unexpected key weight.absmax"; 8-bit: only before its first forward) and a
layer built on the CPU stays in full precision until ``.to(device)``. The subclasses here close those gaps:

* a layer built off the meta device quantizes its weight at once, so a model built under ``fabric.init_module()``
  never holds more than one layer's weight in full precision;
* ``load_state_dict`` accepts either a quantized state (from ``fabric.save`` of a quantized model, loaded
  bit-exactly) or a full-precision weight (a pretrained checkpoint, quantized on load, also into a layer built on
  the meta device);
* a 4-bit layer evaluates on the CPU as it trains (bitsandbytes' CPU inference repacking changes the weight's
  quantization state for good, and fails for small layers);
* the int8 training layer re-quantizes its float16 weight at every forward, so its result never depends on whether
  ``zero_grad()`` ran before the forward (bitsandbytes reuses a stale quantization when ``.grad`` is set), and loads
  a checkpoint into its existing weight parameter: a new parameter object would be invisible to the optimizer and to
  DDP's gradient hooks, which hold the old one (a resume then stepped a parameter the model no longer used).
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import torch
from bitsandbytes.nn import Int8Params, Params4bit
from torch import Tensor

#: keys bitsandbytes saves beside an 8-bit weight
_INT8_EXTRA = ("SCB", "weight_format")


def _split_own(state_dict: dict[str, Any], prefix: str, own: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """This layer's weight entries (``weight``, ``weight.*`` and ``own``) and the rest of its entries."""
    mine, rest = {}, {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name == "weight" or name.startswith("weight.") or name in own:
            mine[name] = value
        else:
            rest[key] = value
    return mine, rest


def _target_device(layer: torch.nn.Module, incoming: Tensor) -> torch.device:
    """Where a loaded weight goes: the layer's device, or the incoming tensor's when the layer is on meta."""
    device = layer.weight.device
    return incoming.device if device.type == "meta" else device


def _load_rest(layer, rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs, had_weight):
    """Load the bias (and anything else) the usual way; the weight was handled by the caller."""
    torch.nn.Module._load_from_state_dict(
        layer, rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    )
    if had_weight and prefix + "weight" in missing_keys:
        missing_keys.remove(prefix + "weight")


class _Linear4bit(bnb.nn.Linear4bit):
    """``bnb.nn.Linear4bit`` with nn.Linear's constructor; quantized as soon as it holds real weights."""

    quant_type = "nf4"
    double_quant = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        # built under BitsandbytesPrecision.module_init_context the default dtype is the precision's dtype
        compute_dtype = compute_dtype or dtype or torch.get_default_dtype()
        super().__init__(
            in_features,
            out_features,
            bias=bias,
            compute_dtype=compute_dtype,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            device=device,
        )
        if self.bias is not None and dtype is not None:
            self.bias.data = self.bias.data.to(dtype)
        # bitsandbytes repacks the weight for an AVX512-BF16 CPU kernel at the first evaluation forward: lossy (the
        # block scales become bfloat16, double quantization is dropped, evaluation then differs from training and
        # every later step trains on the changed weight) and failing for layers its kernel does not tile
        # (out_features not a multiple of 32, in_features not one of the block size). Evaluation keeps the path
        # training takes: an evaluation never changes the model.
        self.support_avx512bf16_for_cpu = False
        if self.weight.device.type != "meta":
            self.quantize_()

    def quantize_(self, weight: Tensor | None = None, device: torch.device | None = None) -> None:
        """Quantize ``weight`` (default: the layer's own full-precision weight) on ``device`` (default: where it is)."""
        if weight is None:
            if self.weight.bnb_quantized:
                return
            weight = self.weight.data
        device = device or weight.device
        param = Params4bit(
            weight.detach(),
            requires_grad=False,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            quant_storage=self.quant_storage,
            module=self,
        )
        self.weight = param._quantize(device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        mine, rest = _split_own(state_dict, prefix, ())
        weight = mine.pop("weight", None)
        if weight is not None:
            device = _target_device(self, weight)
            if mine:  # a quantized state: packed data + its quantization statistics, restored exactly
                self.weight = Params4bit.from_prequantized(
                    weight, quantized_stats=mine, requires_grad=False, device=device, module=self
                )
            elif weight.is_floating_point() and weight.dim() == 2:  # a full-precision checkpoint
                self.quantize_(weight.to(device), device)
            else:
                error_msgs.append(
                    f"{prefix}weight: a packed 4-bit weight without its quantization state ({prefix}weight.absmax, ...)"
                    " cannot be loaded; save the model with `fabric.save` (it writes both) or pass full-precision weights."
                )
        _load_rest(self, rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs, weight is not None)


class NF4Linear(_Linear4bit):
    """4-bit NormalFloat weights (QLoRA)."""

    quant_type, double_quant = "nf4", False


class NF4DQLinear(_Linear4bit):
    """4-bit NormalFloat weights, quantization statistics quantized again (double quantization)."""

    quant_type, double_quant = "nf4", True


class FP4Linear(_Linear4bit):
    """4-bit float weights."""

    quant_type, double_quant = "fp4", False


class FP4DQLinear(_Linear4bit):
    """4-bit float weights with double quantization."""

    quant_type, double_quant = "fp4", True


class _Linear8bit(bnb.nn.Linear8bitLt):
    """``bnb.nn.Linear8bitLt`` with nn.Linear's constructor (LLM.int8, outlier threshold 6.0)."""

    fp16_weights = False

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(
            in_features, out_features, bias=bias, has_fp16_weights=self.fp16_weights, threshold=6.0, device=device
        )
        if dtype is not None:
            if self.bias is not None:
                self.bias.data = self.bias.data.to(dtype)
            if self.fp16_weights:
                self.weight.data = self.weight.data.to(dtype)
        if self.weight.device.type != "meta":
            self.quantize_()

    def quantize_(self, weight: Tensor | None = None, device: torch.device | None = None) -> None:
        """int8 inference: quantize ``weight`` (default: the layer's own) to int8 rows with their scales.
        int8 training keeps float16 weights (quantized at every forward): ``weight`` is only stored."""
        if weight is None:
            if self.fp16_weights or self.weight.dtype == torch.int8:
                return
            weight = self.weight.data
        device = device or weight.device
        param = Int8Params(
            weight.detach().to(device, torch.float16),
            requires_grad=self.fp16_weights,
            has_fp16_weights=self.fp16_weights,
        )
        self.weight = param if self.fp16_weights else param._quantize(device)
        self.state.CB = self.state.SCB = None  # forget a quantization of the previous weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        mine, rest = _split_own(state_dict, prefix, _INT8_EXTRA)
        weight = mine.pop("weight", None)
        scb = mine.pop("SCB", None)
        mine.pop("weight_format", None)  # bitsandbytes writes only its row-major format
        if weight is not None:
            device = _target_device(self, weight)
            if scb is not None:  # a quantized state: int8 rows and their scales, restored exactly
                if self.fp16_weights:
                    error_msgs.append(
                        f"{prefix}: an int8 inference checkpoint (with {prefix}SCB) cannot be loaded into an int8"
                        " *training* layer, which keeps float16 weights; load it with mode='int8'."
                    )
                else:
                    param = Int8Params(weight.to(device), requires_grad=False, has_fp16_weights=False)
                    param.CB, param.SCB = param.data, scb.to(device)
                    self.weight = param
                    self.state.CB = self.state.SCB = None
            elif weight.is_floating_point() and self._holds_trainable_weight(weight):
                # int8 training: into the parameter the optimizer (and DDP's gradient hooks) hold, not a new one
                with torch.no_grad():
                    self.weight.copy_(weight.to(self.weight.device, self.weight.dtype))
                self.state.CB = self.state.SCB = None
            elif weight.is_floating_point():
                self.quantize_(weight, device)
            else:
                error_msgs.append(f"{prefix}weight: int8 weights without their scales ({prefix}SCB) cannot be loaded.")
        _load_rest(self, rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs, weight is not None)

    def _holds_trainable_weight(self, incoming: Tensor) -> bool:
        """Whether ``incoming`` can be copied into the current weight: an int8 training layer's float16 weight,
        real (not on meta) and of the same shape."""
        weight = self.weight
        return self.fp16_weights and weight.device.type != "meta" and weight.shape == incoming.shape

    def forward(self, x: Tensor) -> Tensor:
        if not self.fp16_weights:
            return super().forward(x)
        # bitsandbytes keeps the last quantization while `.grad` is set (and always in eval mode): the weight may
        # have changed since (an optimizer step, a load), so quantize what is there now
        self.state.CB = self.state.SCB = None
        # On CPU/XPU bitsandbytes trains through "quantize, dequantize, float matmul"; its eval path needs a
        # kernel the CPU backend lacks (int8_double_quant) for a weight that requires grad: use the first always.
        self.state.is_training = self.training or x.device.type in ("cpu", "xpu")
        if self.bias is not None and self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        return bnb.matmul(x, self.weight, bias=self.bias, state=self.state)


class Int8InferenceLinear(_Linear8bit):
    """Frozen int8 weights (LLM.int8 inference; train adapters beside them)."""

    fp16_weights = False


class Int8TrainingLinear(_Linear8bit):
    """Trainable float16 weights, int8 matmuls in forward and backward."""

    fp16_weights = True


LAYERS: dict[str, type[torch.nn.Linear]] = {
    "nf4": NF4Linear,
    "nf4-dq": NF4DQLinear,
    "fp4": FP4Linear,
    "fp4-dq": FP4DQLinear,
    "int8": Int8InferenceLinear,
    "int8-training": Int8TrainingLinear,
}
QUANTIZED = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
