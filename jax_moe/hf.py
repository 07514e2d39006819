"""Loading the MoE layers of a local Hugging Face checkpoint into ``moe_stack``'s params.

``load_moe(path, max_tokens=...) -> (MoEConfig, params)`` reads ``config.json`` and the
``*.safetensors`` files (one, or sharded with ``model.safetensors.index.json``) of a Mixtral,
Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE (text model, or the multimodal checkpoint's language model) or
DeepSeek-V3 checkpoint, and returns the params of its MoE layers stacked on a leading axis, in
checkpoint order (DeepSeek-V3's first dense layers are not MoE layers and are skipped). For every
MoE layer i, ``moe_layer(tree_map(lambda a: a[i], params), x, init_scratch(config))[0]`` is that
layer's transformers MoE block applied to x.

Tensors are read one at a time with safetensors' NumPy API (no torch) straight into the stacked
arrays, so the checkpoint is never held twice in host memory; bf16 stays bf16. Both expert layouts
load: per-expert (``experts.{e}.gate_proj/up_proj/down_proj``, Mixtral's ``w1/w3/w2``, as
published checkpoints and transformers' ``save_pretrained`` write them) and fused
(``experts.gate_up_proj`` [E, 2F, H], ``experts.down_proj`` [E, H, F]).

FP8 checkpoints (``quantization_config`` as DeepSeek-V3's and Qwen's -FP8 releases write it: e4m3
weights, float32 ``weight_scale_inv`` per 128 x 128 block) load without dequantising the experts
(any other FP8 Linear, a router say, is dequantised): the params then carry ``gate_up``/
``down`` as float8_e4m3fn with ``gate_up_scale_inv``/``down_scale_inv`` (``jax_moe.fp8``), and the
shared expert's ``shared_gate_up``/``shared_down`` likewise. ``experts_fp8`` chooses: keep or
dequantise an FP8 checkpoint's experts, or quantise a bf16 checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # registers bfloat16 with NumPy (safetensors' NumPy API needs it); float8_e4m3fn
import numpy as np

from jax_moe import fp8
from jax_moe.config import MoEConfig, positive_int

SUPPORTED = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where one family keeps its MoE block and how it routes."""

    prefix: str                # "model." or "model.language_model."
    block: str                 # "mlp" or Mixtral's "block_sparse_moe"
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    routing: dict              # MoEConfig routing fields
    shared_ffn: int | None     # shared expert width, or None
    shared_gate: bool
    router_bias: bool
    expert_names: tuple[str, str, str]  # per-expert gate, up, down tensor names
    fp8: bool = False          # block-scaled e4m3 Linear weights (quantization_config)


def _field(cfg: dict, names, what: str, default: Any = ...) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not ...:
        return default
    raise ValueError(f"load_moe: config.json: expected {what} ({' or '.join(names)}), found none")


def _fp8_checkpoint(quantization: dict | None) -> bool:
    """Whether config.json's quantization_config is DeepSeek-V3's FP8 (else ValueError); False if none."""
    if not quantization:
        return False
    method, fmt = quantization.get("quant_method"), quantization.get("fmt", "e4m3")
    block = list(quantization.get("weight_block_size") or [fp8.BLOCK, fp8.BLOCK])
    if method != "fp8" or fmt != "e4m3" or block != [fp8.BLOCK, fp8.BLOCK]:
        raise ValueError(f"load_moe: config.json: quantization_config: expected DeepSeek-V3's FP8 (quant_method "
                         f"'fp8', fmt 'e4m3', weight_block_size [128, 128]), got {quantization}")
    return True


def _layout(config: dict) -> _Layout:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"load_moe: config.json: model_type: expected one of {SUPPORTED}, got {model_type!r}")
    prefix = "model."
    cfg = config
    if model_type == "qwen3_5_moe":  # the multimodal checkpoint: the language model's config and tensors
        cfg = config.get("text_config")
        if not isinstance(cfg, dict):
            raise ValueError("load_moe: config.json: text_config: expected the language model's config "
                             "(model_type qwen3_5_moe), found none")
        prefix = "model.language_model."
    is_fp8 = _fp8_checkpoint(cfg.get("quantization_config") or config.get("quantization_config"))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"load_moe: config.json: hidden_act: expected 'silu' (SwiGLU experts), got {act!r}")
    num_layers = int(_field(cfg, ("num_hidden_layers",), "the layer count"))
    num_experts = int(_field(cfg, ("num_local_experts", "num_experts", "n_routed_experts"), "the expert count"))
    top_k = int(_field(cfg, ("num_experts_per_tok",), "the experts per token"))
    hidden = int(_field(cfg, ("hidden_size",), "the hidden size"))
    per_expert = ("gate_proj", "up_proj", "down_proj")
    if model_type == "mixtral":
        return _Layout(prefix, "block_sparse_moe", tuple(range(num_layers)), num_experts, top_k, hidden,
                       int(_field(cfg, ("intermediate_size",), "the expert width")), {}, None, False, False,
                       ("w1", "w3", "w2"), is_fp8)
    ffn = int(_field(cfg, ("moe_intermediate_size",), "the expert width"))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        layers = tuple(i for i in range(num_layers) if i not in only_mlp and num_experts > 0 and (i + 1) % step == 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        routing = {"renormalize": bool(cfg.get("norm_topk_prob", False))}
        return _Layout(prefix, "mlp", layers, num_experts, top_k, hidden, ffn, routing, shared or None, bool(shared),
                       False, per_expert, is_fp8)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        shared = int(_field(cfg, ("shared_expert_intermediate_size",), "the shared expert width"))
        return _Layout(prefix, "mlp", tuple(range(num_layers)), num_experts, top_k, hidden, ffn, {"renormalize": True},
                       shared, True, False, per_expert, is_fp8)
    # DeepSeek-V3
    for name, allowed in (("scoring_func", ("sigmoid",)), ("topk_method", ("noaux_tc",)), ("moe_layer_freq", (1,))):
        if cfg.get(name) is not None and cfg[name] not in allowed:
            raise ValueError(f"load_moe: config.json: {name}: expected one of {allowed} (DeepSeek-V3's routing as "
                             f"transformers runs it), got {cfg[name]!r}")
    first_moe = int(cfg.get("first_k_dense_replace", 0) or 0)
    shared = int(cfg.get("n_shared_experts", 0) or 0) * ffn
    routing = {"scoring": "sigmoid", "renormalize": bool(cfg.get("norm_topk_prob", True)), "renormalize_epsilon": 1e-20,
               "n_group": int(cfg.get("n_group", 1) or 1), "topk_group": int(cfg.get("topk_group", 1) or 1),
               "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0))}
    return _Layout(prefix, "mlp", tuple(range(first_moe, num_layers)), num_experts, top_k, hidden, ffn, routing,
                   shared or None, False, True, per_expert, is_fp8)


class _Tensors:
    """Reads named tensors one at a time from a checkpoint folder's safetensors files."""

    def __init__(self, folder: pathlib.Path):
        try:
            from safetensors import safe_open
        except ImportError as e:  # an optional dependency: pip install "jax_moe[hf]"
            raise ImportError("jax_moe.hf needs the safetensors package: pip install safetensors") from e
        self._open = safe_open
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ValueError(f"load_moe: path: expected *.safetensors files in {folder}, found none")
            self.files = {}
            for file in files:
                with safe_open(file, framework="np") as f:
                    self.files.update({name: file for name in f.keys()})
        self._handles = {}
        self._headers = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _raw(self, file: pathlib.Path, name: str) -> np.ndarray | None:
        """An F8_E4M3 tensor read from the file's bytes (safetensors' NumPy API has no float8), else None."""
        if file not in self._headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[file]
        entry = header.get(name, {})
        if entry.get("dtype") != "F8_E4M3":
            return None
        begin, end = entry["data_offsets"]
        data = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
        return data.view(ml_dtypes.float8_e4m3fn).reshape(entry["shape"])

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.files:
            raise ValueError(f"load_moe: tensor {name!r}: expected in the checkpoint, missing")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(file, framework="np").__enter__()
        tensor = self._raw(file, name)
        if tensor is None:
            tensor = self._handles[file].get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"load_moe: tensor {name!r}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
        return tensor

    def close(self):
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}


_SAFETENSORS_DTYPES = {"F32": jnp.float32, "BF16": jnp.bfloat16, "F16": jnp.float16}


def _checkpoint_dtype(config: dict, tensors: _Tensors, probe: str):
    """The dtype config.json names, else the dtype of the tensor ``probe``."""
    name = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if name in _DTYPES:
        return jnp.dtype(_DTYPES[name])
    if probe not in tensors:
        raise ValueError(f"load_moe: tensor {probe!r}: expected in the checkpoint, missing")
    with tensors._open(tensors.files[probe], framework="np") as f:
        stored = f.get_slice(probe).get_dtype()
    if stored not in _SAFETENSORS_DTYPES:
        raise ValueError(f"load_moe: tensor {probe!r}: expected dtype F32, BF16 or F16, got {stored}")
    return jnp.dtype(_SAFETENSORS_DTYPES[stored])


def load_moe(path, *, max_tokens: int, dtype=None, experts_fp8: bool | None = None) -> tuple[MoEConfig, dict]:
    """The routing config and the stacked params of a Hugging Face checkpoint's MoE layers.

    Args:
      path: a local folder with ``config.json`` and ``*.safetensors`` (sharded with
        ``model.safetensors.index.json`` or not) of a supported model (``SUPPORTED``).
      max_tokens: the ``MoEConfig.max_tokens`` to size scratches for.
      dtype: params' and rows' dtype; None keeps the checkpoint's (bf16 stays bf16).
      experts_fp8: the routed and shared experts as FP8 (``jax_moe.fp8``: float8_e4m3fn
        ``gate_up``/``down``, ``shared_gate_up``/``shared_down``, and their ``*_scale_inv``): None
        keeps what the checkpoint stores (FP8 checkpoints, DeepSeek-V3's or Qwen's -FP8, stay FP8,
        needing H, F and the shared width multiples of 128), True also quantises a bf16/f32 checkpoint's experts,
        False dequantises an FP8 checkpoint's.

    Returns:
      ``(config, params)``: a ``MoEConfig`` with the model's E, k, H and routing (softmax with or
      without renormalisation; DeepSeek-V3's sigmoid, groups, correction bias and scaling), and
      ``{"router": [L, H, E], "gate_up": [L, E, H, 2F], "down": [L, E, F, H]}`` plus, where the
      model has them, ``router_bias`` [L, E] float32 and the shared expert's ``shared_gate_up``
      [L, H, 2Fs], ``shared_down`` [L, Fs, H], ``shared_gate`` [L, H, 1]. L = the MoE layers.
      FP8 experts keep the checkpoint's [out, in] layout: ``gate_up`` [L, E, 2F, H] and ``down``
      [L, E, H, F] float8_e4m3fn with ``gate_up_scale_inv`` [L, E, 2F/128, H/128] and
      ``down_scale_inv`` [L, E, H/128, F/128] (float32); an FP8 shared expert likewise without E
      (``shared_gate_up`` [L, 2Fs, H], ``shared_down`` [L, H, Fs] and their ``*_scale_inv``).

    Raises:
      ValueError: an unsupported architecture, a config field it cannot honour, a missing or
        misshapen tensor (named), or no MoE layer.
    """
    positive_int("load_moe: max_tokens", max_tokens)
    folder = pathlib.Path(path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ValueError(f"load_moe: path: expected a checkpoint folder with config.json, got {str(folder)!r}")
    hf_config = json.loads(config_file.read_text())
    layout = _layout(hf_config)
    if not layout.moe_layers:
        raise ValueError("load_moe: config.json: expected at least one MoE layer, found none")
    tensors = _Tensors(folder)
    try:
        first = f"{layout.prefix}layers.{layout.moe_layers[0]}.{layout.block}.gate.weight"
        if layout.block == "block_sparse_moe" and first not in tensors:  # Mixtral saved as transformers names it
            layout = dataclasses.replace(layout, block="mlp")
            first = f"{layout.prefix}layers.{layout.moe_layers[0]}.mlp.gate.weight"
        out_dtype = jnp.dtype(dtype) if dtype is not None else _checkpoint_dtype(hf_config, tensors, first)
        config = MoEConfig(num_experts=layout.num_experts, top_k=layout.top_k, hidden_size=layout.hidden,
                           max_tokens=max_tokens, dtype=out_dtype, **layout.routing)
        keep_fp8 = layout.fp8 and experts_fp8 is not False
        shared_width = layout.shared_ffn or fp8.BLOCK
        if (keep_fp8 or experts_fp8) and (layout.hidden % fp8.BLOCK or layout.ffn % fp8.BLOCK
                                          or shared_width % fp8.BLOCK):
            what, instead = (("keeping", "pass experts_fp8=False to dequantise them") if keep_fp8 else
                             ("quantising", "leave experts_fp8 None to keep them as stored"))
            raise ValueError(f"load_moe: experts_fp8: {what} the FP8 experts needs H, F and the shared expert's "
                             f"width multiples of {fp8.BLOCK} (gate and up share one scale grid), got "
                             f"H={layout.hidden}, F={layout.ffn}, Fs={layout.shared_ffn}; {instead}")
        params = _read_params(tensors, layout, out_dtype, keep_fp8)
    finally:
        tensors.close()
    params = {name: jnp.asarray(array) for name, array in params.items()}
    if experts_fp8 and not keep_fp8:
        params = fp8.quantize_params(params)
    return config, params


def _dequantize(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """[out, in] e4m3 weight times its [ceil(out/128), ceil(in/128)] block scales, float32.

    fp8.dequantize's math in NumPy: the loader stays on the host, one tensor at a time."""
    out_f, in_f = weight.shape
    full = np.repeat(np.repeat(scale_inv, fp8.BLOCK, axis=0), fp8.BLOCK, axis=1)[:out_f, :in_f]
    return weight.astype(np.float32) * full


def _read_params(tensors: _Tensors, layout: _Layout, dtype, keep_fp8: bool = False) -> dict:
    L, E, H, F = len(layout.moe_layers), layout.num_experts, layout.hidden, layout.ffn
    np_dtype = np.dtype(dtype)
    expert_dtype = np.dtype(ml_dtypes.float8_e4m3fn) if keep_fp8 else np_dtype
    params = {"router": np.empty((L, H, E), np_dtype)}

    def scales(name: str, out_f: int, in_f: int) -> np.ndarray:
        return tensors.get(name + ".weight_scale_inv", (fp8.num_blocks(out_f), fp8.num_blocks(in_f)))

    def linear(name: str, out_f: int, in_f: int) -> np.ndarray:
        """A Linear weight [out, in], dequantised when the checkpoint stores it as FP8."""
        weight = tensors.get(name + ".weight", (out_f, in_f))
        if weight.dtype == ml_dtypes.float8_e4m3fn:
            weight = _dequantize(weight, scales(name, out_f, in_f))
        return weight

    def fp8_linear(name: str, out_f: int, in_f: int) -> tuple[np.ndarray, np.ndarray]:
        """An FP8 Linear weight [out, in] and its scales, as stored."""
        weight = tensors.get(name + ".weight", (out_f, in_f))
        if weight.dtype != ml_dtypes.float8_e4m3fn:
            raise ValueError(f"load_moe: tensor {name + '.weight'!r}: expected F8_E4M3 (quantization_config "
                             f"says FP8), got {weight.dtype}; pass experts_fp8=False")
        return weight, scales(name, out_f, in_f)

    def allocate_swiglu(key: str, lead: tuple[int, ...], width: int) -> None:
        """``params[key + "gate_up"]`` and ``[key + "down"]`` for SwiGLU experts of this width: the
        checkpoint's [out, in] ([.., 2w, H], [.., H, w]) with their scale grids when FP8 is kept
        (jax_moe.fp8), else [in, out] ([.., H, 2w], [.., w, H])."""
        if keep_fp8:
            blocks_h, blocks_w = fp8.num_blocks(H), fp8.num_blocks(width)
            params[key + "gate_up"] = np.empty(lead + (2 * width, H), expert_dtype)
            params[key + "down"] = np.empty(lead + (H, width), expert_dtype)
            params[key + "gate_up" + fp8.SCALE_SUFFIX] = np.empty(lead + (2 * blocks_w, blocks_h), np.float32)
            params[key + "down" + fp8.SCALE_SUFFIX] = np.empty(lead + (blocks_h, blocks_w), np.float32)
        else:
            params[key + "gate_up"] = np.empty(lead + (H, 2 * width), expert_dtype)
            params[key + "down"] = np.empty(lead + (width, H), expert_dtype)

    def read_swiglu(prefix: str, names: tuple[str, str, str], width: int, key: str, index: tuple[int, ...]) -> None:
        """One SwiGLU expert's gate, up and down Linears into ``params[key + ...][index]``: as stored
        when FP8 is kept (gate rows above up rows, and so their scale grids), else dequantised and
        transposed to [in, out] (gate columns, then up)."""
        gate_up, blocks = params[key + "gate_up"][index], fp8.num_blocks(width)  # a view: written in place
        for part, name in enumerate(names[:2]):
            if keep_fp8:
                weight, scale = fp8_linear(prefix + name, width, H)
                gate_up[part * width:(part + 1) * width] = weight
                params[key + "gate_up" + fp8.SCALE_SUFFIX][index][part * blocks:(part + 1) * blocks] = scale
            else:
                gate_up[:, part * width:(part + 1) * width] = linear(prefix + name, width, H).T
        if keep_fp8:
            params[key + "down"][index], params[key + "down" + fp8.SCALE_SUFFIX][index] = fp8_linear(
                prefix + names[2], H, width)
        else:
            params[key + "down"][index] = linear(prefix + names[2], H, width).T

    allocate_swiglu("", (L, E), F)
    if layout.router_bias:
        params["router_bias"] = np.empty((L, E), np.float32)
    if layout.shared_ffn:
        allocate_swiglu("shared_", (L,), layout.shared_ffn)
    if layout.shared_gate:
        params["shared_gate"] = np.empty((L, H, 1), np_dtype)
    for i, layer in enumerate(layout.moe_layers):
        block = f"{layout.prefix}layers.{layer}.{layout.block}."
        # transformers' Linear weights are [out, in]; moe_stack multiplies x [T, in] @ w [in, out].
        params["router"][i] = linear(block + "gate", E, H).T  # (an FP8 checkpoint's router is dequantised)
        if layout.router_bias:
            params["router_bias"][i] = tensors.get(block + "gate.e_score_correction_bias", (E,))
        # transformers 5's fused experts: [E, 2F, H] (gate rows first), [E, H, F]; else one per expert.
        if not keep_fp8 and block + "experts.gate_up_proj" in tensors:
            params["gate_up"][i] = tensors.get(block + "experts.gate_up_proj", (E, 2 * F, H)).transpose(0, 2, 1)
            params["down"][i] = tensors.get(block + "experts.down_proj", (E, H, F)).transpose(0, 2, 1)
        else:
            for e in range(E):
                read_swiglu(f"{block}experts.{e}.", layout.expert_names, F, "", (i, e))
        if layout.shared_ffn:
            shared = block + ("shared_experts." if layout.router_bias else "shared_expert.")
            read_swiglu(shared, ("gate_proj", "up_proj", "down_proj"), layout.shared_ffn, "shared_", (i,))
        if layout.shared_gate:
            params["shared_gate"][i] = linear(block + "shared_expert_gate", 1, H).T
    return params
