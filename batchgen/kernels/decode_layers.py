"""A decode step's decoder layers in one C call (``csrc/decode_layers.c``), for Llama-shaped layers
of a bf16 model on a CPU: bf16 products on `bf16_gemm` or W8A8 ones on `int8_gemm`, over a bf16
or an int8 K/V pool.

`fused_decoder.FusedDecoder.forward` calls some nine kernels a layer from Python; at a decode
step's few rows the Python, ctypes and allocation work around them costs several times its own
time beside the kernels (docs/performance.md). `DecodeLayers.run` hands the same kernels, with the
same arguments and in the same order, to one C loop over the layers: the step's results are the
same bits.

Invariants:
- `DecodeLayers.of` returns None unless every layer is one that ``decode_layers.c`` runs: the
  Llama layer (attention norm, q|k|v, rotary embeddings with optional q/k RMSNorms, full
  attention, o, MLP norm, gated [gate; up] then down products, no post-norms, no scaled
  residuals, RMSNorms with bf16 weights, a gated MLP whose activation the int8 product or
  `decoder_ops`' pass applies), every product on `bf16_gemm` or W8A8 on `int8_gemm`, and the
  kernels' libraries built here.
- `takes` a step only where every row is a decode row, no torch profiler records, the backend's
  decode kernel is one whose C entry point the loop calls (`kv_int8`'s over an int8 pool; the
  AMX or C kernel over a bf16 one) and the bf16 products' rows run on `bf16_gemm`; `run` reads
  and writes the buffers `FusedDecoder.forward` would (`rows.normed` holds the first layer's
  attention norm on entry and the final norm on return).
- Its only state is each layer's constants, read once: pointers into the decoder's packed weights
  and norms, so it lives as long as the decoder that holds them (as its attribute).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from batchgen.kernels import amx_attention, bf16_gemm, cpu_attention, decoder_ops, int8_gemm, kv_int8
from batchgen.kernels.attention_kernel import check_inputs
from batchgen.kernels.c_library import load_library, pointer
from batchgen.kernels.cpu_linear import PackedWeight
from batchgen.kernels.kernel_status import check_status
from batchgen.kernels.profiler_spans import profiler_enabled

_POINTER, _INT, _INT64, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# the decode kernels the loop calls in C in their place, as imported (a function put in their place later runs as it is)
INT8_POOL_DECODE = kv_int8.paged_decode_attention
AMX_DECODE, CPU_DECODE = amx_attention.paged_decode_attention, cpu_attention.paged_decode_attention


class _Kernels(ctypes.Structure):
    _fields_ = [("add_rms_norm", _POINTER), ("int8_linear", _POINTER), ("bf16_linear", _POINTER),
                ("rope_write_kv", _POINTER)]


PRODUCT_BF16, PRODUCT_INT8 = 0, 1  # decode_layers.c's PRODUCT_*
PRODUCT_KERNELS = {PRODUCT_BF16: (bf16_gemm.library, "bg_bf16_linear"),  # kind -> (its library, its entry point)
                   PRODUCT_INT8: (int8_gemm.library, "bg_int8_linear")}


class _Product(ctypes.Structure):
    _fields_ = [("kind", _INT), ("smoothing", _POINTER), ("panels", _POINTER), ("scales", _POINTER),
                ("compensation", _POINTER), ("bias", _POINTER), ("in_features", _INT64), ("padded_inputs", _INT64),
                ("out_features", _INT64), ("gated", _INT)]


class _Norm(ctypes.Structure):
    _fields_ = [("weight", _POINTER), ("eps", _FLOAT)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Product), ("o", _Product), ("mlp_in", _Product), ("mlp_out", _Product),
                ("mlp_norm", _Norm), ("next_norm", _Norm), ("activation", _POINTER), ("q_norm", _POINTER),
                ("k_norm", _POINTER), ("qk_norm_width", _INT), ("qk_norm_kind", _INT), ("qk_norm_eps", _FLOAT),
                ("scale", _FLOAT)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _POINTER) for name in ("float_decode", "kv_store", "int8_decode", "residual", "normed", "qkv",
                                              "heads", "keys", "attended", "gate_up", "hidden", "out", "scratch_k",
                                              "scratch_v", "quantized", "scratch_slots", "slots", "block_tables",
                                              "context_lens", "groups", "layers")] + [
        ("rows", _INT64), ("num_slots", _INT64)] + [
        (name, _INT) for name in ("num_tokens", "num_groups", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                                  "num_blocks", "block_size", "max_blocks", "num_threads")]


@functools.cache
def library() -> ctypes.CDLL | None:
    library = load_library("decode_layers.c")
    if library is not None:
        library.bg_decode_layers.argtypes = [_POINTER, _POINTER, _POINTER, _INT]
        library.bg_decode_layers.restype = _INT
    return library


def _kernels(kinds: set[int]) -> _Kernels | None:
    """The entry points of the decoder ops and of the product kernels of `kinds` (PRODUCT_*; 0 for
    another kind), where each is built here."""
    ops = decoder_ops.library()
    entries = {kind: _address(load(), name) for kind, (load, name) in PRODUCT_KERNELS.items() if kind in kinds}
    if ops is None or None in entries.values():
        return None
    return _Kernels(_address(ops, "bg_add_rms_norm"), entries.get(PRODUCT_INT8), entries.get(PRODUCT_BF16),
                    _address(ops, "bg_rope_write_kv"))


def _entry(function) -> int:
    """A ctypes function's address."""
    return ctypes.cast(function, _POINTER).value


def _address(built: ctypes.CDLL | None, name: str) -> int | None:
    return None if built is None else _entry(getattr(built, name))


@functools.cache
def _int8_pool_kernels() -> tuple[int, int]:
    """`kv_int8`'s store and decode entry points (an int8 pool's step runs on them: `takes`)."""
    built = kv_int8.library()
    return _address(built, "bg_kv_int8_store"), _address(built, "bg_kv_int8_decode_attention")


@functools.cache
def _float_decodes() -> dict:
    """A bf16 pool's decode kernels (`attention.NativeBackend.decode`) -> their C entry points."""
    amx, cpu = amx_attention.load_kernel(), cpu_attention.load_kernel()
    entries = {AMX_DECODE: _address(amx, "bg_amx_decode_attention"), CPU_DECODE: cpu and _entry(cpu.decode)}
    return {decode: entry for decode, entry in entries.items() if entry is not None}


def is_available() -> bool:
    """Whether this machine's builds hold the loop and the decoder ops it calls."""
    return library() is not None and decoder_ops.library() is not None


def _product(packed: PackedWeight | None, in_features: int) -> _Product | None:
    """`packed`'s constants, where it is a product on `bf16_gemm` or a W8A8 one on `int8_gemm` of
    one part per row."""
    if packed is None or packed.dense is not None:
        return None
    weight = packed.int8
    if weight is None:
        return None if packed.panels is None else _Product(PRODUCT_BF16, None, packed.panels.data_ptr(), None, None,
                                                           pointer(packed.bias), in_features, in_features,
                                                           packed.out_features, 0)
    if weight.panels is None or not weight.activations_quantized or weight.split_inputs:
        return None
    return _Product(PRODUCT_INT8, pointer(weight.smoothing), weight.panels.data_ptr(), weight.scales.data_ptr(),
                    weight.compensation.data_ptr(), pointer(packed.bias), in_features,
                    int8_gemm.padded_inputs(in_features), packed.out_features,
                    int8_gemm.GATED_ACTIVATIONS.get(weight.gated, 0))


def _norm(norm) -> _Norm | None:
    """A `fused_decoder.FusedNorm` as the C loop takes it: Llama's RMSNorm only."""
    return None if norm is None or norm.kind != "rms" else _Norm(norm.weight.data_ptr(), norm.eps)


def _layer(layer, next_norm, hidden_size: int, num_heads: int, head_dim: int, activation: int | None) -> _Layer | None:
    """A `fused_decoder.FusedLayer`'s constants, where ``decode_layers.c`` runs it; `activation`:
    the gated MLP's activation pass (its C entry point), for a product that does not apply it."""
    if (layer.moe is not None or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
            or _norm(layer.attn_norm) is None or not layer.variant.is_full or layer.mlp_in is None
            or (layer.mlp_in.gated is None and activation is None)):
        return None
    products = [_product(layer.qkv, hidden_size), _product(layer.o, num_heads * head_dim),
                _product(layer.mlp_in, hidden_size), _product(layer.mlp_out, layer.mlp_in.out_features // 2)]
    norms = [_norm(layer.mlp_norm), _norm(next_norm)]
    if None in products or None in norms:
        return None
    qk_norm = layer.qk_norm or decoder_ops.NO_QK_NORM  # as `decoder_ops.rope_write_kv` passes it
    return _Layer(*products, *norms, None if layer.mlp_in.gated else activation, pointer(qk_norm.q_weight),
                  pointer(qk_norm.k_weight), head_dim if qk_norm.per_head else 0,
                  decoder_ops.QK_NORM_KINDS[qk_norm.kind], qk_norm.eps, layer.scale)


@dataclass(frozen=True)
class DecodeLayers:
    """A decoder's layers as ``decode_layers.c`` runs them (see the module docstring)."""

    kernels: _Kernels
    layers: ctypes.Array  # of _Layer, one a layer
    hidden_size: int
    num_heads: int
    head_dim: int
    qkv_width: int  # the widest layer's q|k|v product
    gate_up_width: int  # the widest layer's gate|up rows where an activation pass follows; else 0
    mlp_width: int  # the widest layer's gated MLP rows
    largest_padded_inputs: int  # of every int8 product: the quantized rows' scratch per row; else 0
    max_rows: int  # the most rows its bf16 products run on `bf16_gemm`

    @classmethod
    def of(cls, decoder, activation: str | None) -> DecodeLayers | None:
        """`decoder`'s (a `fused_decoder.FusedDecoder` of a bf16 model) layers, where
        ``decode_layers.c`` runs every one; `activation`: its gated MLP's (``silu`` or
        ``gelu_tanh``, `decoder_ops`' passes), or None."""
        spec = decoder.spec
        if (not is_available() or spec.parallel or spec.residual_scale is not None or _norm(decoder.final_norm) is None
                or decoder.final_norm.weight.dtype != torch.bfloat16):
            return None
        hidden_size = decoder.final_norm.weight.numel()
        activation_pass = None if activation is None else _address(decoder_ops.library(), f"bg_{activation}_mul")
        next_norms = [layer.attn_norm for layer in decoder.layers[1:]] + [decoder.final_norm]
        layers = [_layer(layer, next_norm, hidden_size, decoder.num_heads, decoder.head_dim, activation_pass)
                  for layer, next_norm in zip(decoder.layers, next_norms)]
        if None in layers:
            return None
        products = [product for layer in layers for product in (layer.qkv, layer.o, layer.mlp_in, layer.mlp_out)]
        kernels = _kernels({product.kind for product in products})
        if kernels is None:
            return None
        packed = [weight for layer in decoder.layers for weight in (layer.qkv, layer.o, layer.mlp_in, layer.mlp_out)
                  if weight.int8 is None]
        return cls(kernels, (_Layer * len(layers))(*layers), hidden_size, decoder.num_heads, decoder.head_dim,
                   max(layer.qkv.out_features for layer in layers),
                   max((layer.mlp_in.out_features for layer in layers if layer.activation), default=0),
                   max(layer.mlp_out.in_features for layer in layers),
                   max((product.padded_inputs for product in products if product.kind == PRODUCT_INT8), default=0),
                   min((weight.kernel_rows for weight in packed), default=bf16_gemm.UNLIMITED_ROWS))

    def takes(self, step, rows) -> bool:
        """Whether `run` takes `step` (an `attention.AttentionStep`) of `rows` (a
        `fused_decoder.StepRows`): every row a decode row, over an int8 pool whose decode rows run
        on `kv_int8`'s kernel or a bf16 pool on a C kernel, each bf16 product on `bf16_gemm`; not
        while a torch profiler records, so that each kernel shows as its own span there."""
        metadata, pool = step.metadata, step.k_caches[0]
        decode = getattr(step.backend, "decode", None)
        pool_runs = (decode is INT8_POOL_DECODE if kv_int8.is_int8(pool)
                     else pool.dtype == torch.bfloat16 and decode in _float_decodes())
        return (pool_runs and not profiler_enabled() and metadata.num_decode_seqs == rows.num_tokens
                and len(rows.residual) <= self.max_rows and metadata.slot_mapping.dtype == torch.int64
                and metadata.decode_seqs.on_cpu_contiguous
                and all(cache.is_contiguous() for cache in (*step.k_caches, *step.v_caches)))

    def run(self, rows, keys: torch.Tensor, kv_target: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
            rotations: list[tuple[torch.Tensor, torch.Tensor]], step) -> bool:
        """Every layer of a step that `takes`, on `rows` (a `fused_decoder.StepRows`), `keys` and,
        for an int8 pool, `kv_target` (`FusedDecoder.int8_kv_target`), each layer rotated by its
        (cos, sin); False where the kernels do not run this pool's shapes (the caller then runs the
        step its own way, from the start: what was written is what that writes again)."""
        metadata = step.metadata
        seqs, num_tokens, padded_rows = metadata.decode_seqs, rows.num_tokens, len(rows.residual)
        pools = list(zip(step.k_caches, step.v_caches))
        check_inputs(rows.heads[:num_tokens], *pools[0], seqs, rows.attended[:num_tokens])
        # decode_layers.c's LayerStep of each layer: k_cache, v_cache, cos, sin, rotary_dim (8 bytes each)
        layer_steps = torch.tensor([[k_cache.data_ptr(), v_cache.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                     cos.shape[-1] if cos.numel() else 0]
                                    for (k_cache, v_cache), (cos, sin) in zip(pools, rotations)], dtype=torch.int64)
        buffers = [rows.residual.new_empty((padded_rows, width)) for width in (self.qkv_width, self.gate_up_width,
                                                                               self.mlp_width, self.hidden_size)]
        scratch_k, scratch_v, scratch_slots = (None, None, None) if kv_target is None else kv_target
        quantized = (int8_gemm.scratch_address(padded_rows * (self.largest_padded_inputs + 4))
                     if self.largest_padded_inputs else None)  # only int8 products use it
        num_blocks, block_size, num_kv_heads, _ = step.k_caches[0].shape
        float_decode = None if kv_target is not None else _float_decodes()[step.backend.decode]
        kv_store, int8_decode = (None, None) if kv_target is None else _int8_pool_kernels()
        qkv, gate_up, hidden, out = (buffer.data_ptr() for buffer in buffers)
        c_step = _Step(float_decode, kv_store, int8_decode, rows.residual.data_ptr(), rows.normed.data_ptr(), qkv,
                       rows.heads.data_ptr(), keys.data_ptr(), rows.attended.data_ptr(), gate_up, hidden, out,
                       pointer(scratch_k), pointer(scratch_v), quantized, pointer(scratch_slots),
                       metadata.slot_mapping.data_ptr(),
                       seqs.block_tables.data_ptr(), seqs.context_lens.data_ptr(), pointer(seqs.groups),
                       layer_steps.data_ptr(), padded_rows, num_blocks * block_size, num_tokens, seqs.num_groups,
                       self.num_heads, num_kv_heads, self.head_dim, self.hidden_size, num_blocks, block_size,
                       seqs.block_tables.shape[1], torch.get_num_threads())
        status = library().bg_decode_layers(ctypes.addressof(self.kernels), ctypes.addressof(c_step),
                                            ctypes.addressof(self.layers), len(self.layers))
        return check_status("decode_layers", status)
