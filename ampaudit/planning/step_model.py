"""A whole training step of a Llama-style transformer under FSDP, in bf16 and in a low-precision recipe, from
its shapes: the per-Linear roofline of speed.py plus everything else a step runs.

    runs = load_runs()                                   # rules/policy/speed_published.toml
    step = step_seconds(runs["torchao_h100"], "float8_tensorwise")
    step["total"], step["parts"]["attention"]            # seconds per step on one GPU, and one part of it
    compare(runs["torchao_h100"])                        # [Comparison(recipe, predicted, published, error), ...]
    step_seconds(runs["torchtitan_h100"], "bfloat16", compiled=False)   # the same step without torch.compile

What a step is made of, per GPU (``parts``), each at the achievable rates of rules/policy/gpus.toml
[efficiency] (torchao's roofline: 78% of peak math, 92% of HBM bandwidth, a 2 us floor per kernel):

- ``gemm_low`` and ``gemm_bf16``: the block Linears' three GEMMs each (speed.gemm_seconds), in the recipe's
  format or in bf16 (all of them in a bf16 step; a recipe's high-precision grad_weight; the Linears a run keeps
  high precision, e.g. the output projection), plus the forward GEMMs activation checkpointing recomputes. torchtitan's per-op selective AC saves every other matmul of a block (torchtitan
  models/llama3/infra/parallelize.py, ``_save_list`` and "Saves output of all compute ops, except every second
  mm"), so the 2nd, 4th and 6th of wq, wk, wv, wo, w1, w3, w2 are run again in backward, in their own format.
- ``casts``: torchao's scale-and-cast kernels (speed.cast_kernels), compiled. One cast of a tensor serves every
  Linear that reads it (wq, wk, wv share one input, w1 and w3 another): AOTAutograd's common-subexpression pass
  (torch._functorch.config.cse, on by default) merges the identical casts. With float8 all-gather, each rank
  casts its fp32 weight shard before the all-gather (amax of all shards precomputed once a step), and backward
  only copies the gathered fp8 weight to the column-major layout ``torch._scaled_mm`` needs. Rowwise adds the
  pass that rescales its backward GEMMs' outputs (speed.rescale_kernels).
- ``attention``: causal FlashAttention-2 at its measured rates ([attention] of gpus.toml), always bf16.
- ``pointwise``: norms, RoPE, SwiGLU, residual adds and their backward, as the fused kernels torch.compile makes
  of one block (bytes at its inputs and outputs only), run again in backward by the checkpointing; the
  embedding, and the cross-entropy in fp32, uncompiled, as torchtitan runs its loss. ``compiled=False`` counts
  the block's ops one kernel each instead, as eager PyTorch runs them: that is the gain of compile's fusion
  (bf16 only; eager float8 casts, each its own amax and cast kernels, are not modelled).
- ``optimizer``: fused AdamW and gradient-norm clipping over the fp32 shard (torchtitan's defaults).
- ``fsdp_copies``: FSDP2's copies around its collectives (the cast of each shard to bf16 before all-gather,
  split_with_sizes_copy after it, the fp32 copy of the gradients before reduce-scatter).
- ``communication``: the all-gathers (twice a step: forward, and backward after resharding) and fp32
  reduce-scatters over NVLink at half the datasheet's two-way bandwidth; only what a layer's compute does not
  hide counts (forward hides one all-gather, backward one all-gather and one reduce-scatter; forward taken as a
  third of a layer's compute), plus the first all-gather and the last reduce-scatter, which nothing hides.

Left out, and why the model is an estimate: the power limit of the published GPUs (no datasheet gives the
sustained clocks at 500 W), kernel overlap, NCCL's share of the SMs while it overlaps compute, the host, and the
data loader. No constant is fitted to the published runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ampaudit.errors import RuleError, UsageError
from ampaudit.planning import speed
from ampaudit.policy import read_toml, rules_dir

__all__ = ["Shapes", "Run", "Comparison", "load_runs", "step_seconds", "compare", "ratio_tolerance", "known_misses"]

BF16, FP32 = 2, 4
ADAMW_BYTES = 7 * FP32   # fused AdamW reads param, grad, exp_avg, exp_avg_sq and writes param and both moments
CLIP_BYTES = 3 * FP32    # clip_grad_norm_: read every grad for the norm, then read and write it scaled


@dataclass(frozen=True)
class Linear:
    name: str
    k: int        # in_features
    n: int        # out_features
    group: str    # the activation it reads (Linears of one group share one input cast)


@dataclass(frozen=True)
class Shapes:
    layers: int
    dim: int
    ffn_dim: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * self.kv_heads

    def block_linears(self) -> tuple[Linear, ...]:
        """A block's Linears in the order forward calls them (Llama: attention, then the SwiGLU MLP)."""
        d, kv, f = self.dim, self.kv_dim, self.ffn_dim
        return (Linear("wq", d, d, "attention_norm"), Linear("wk", d, kv, "attention_norm"),
                Linear("wv", d, kv, "attention_norm"), Linear("wo", d, d, "attention"),
                Linear("w1", d, f, "ffn_norm"), Linear("w3", d, f, "ffn_norm"), Linear("w2", f, d, "swiglu"))

    def block_params(self) -> int:
        return sum(lin.k * lin.n for lin in self.block_linears()) + 2 * self.dim


@dataclass(frozen=True)
class Run:
    name: str
    model: Shapes
    gpu: str
    gpus: int
    local_batch: int
    seq_len: int
    fsdp: int
    compile: bool
    ac: str
    reduce_bytes: int
    high_precision: tuple[str, ...]
    float8_all_gather: tuple[str, ...]
    baseline: str
    published: dict
    source: str
    config: str
    published_eager: float = 0.0   # bf16 tokens/s per GPU of the same run without torch.compile (0: none)
    # Assumptions no source settles, as switches for what-ifs (bench/speed_published.py --sensitivity):
    cse: bool = True               # identical casts of a shared input merged by AOTAutograd's CSE
    recompute_all_low: bool = False   # AC recomputes every low-precision forward GEMM (compiled: unchecked)

    @property
    def tokens(self) -> int:
        return self.local_batch * self.seq_len


@dataclass(frozen=True)
class Comparison:
    run: str
    recipe: str
    predicted: float        # speed-up over the run's baseline, predicted
    published: float        # the same, published
    predicted_tps: float    # tokens/s per GPU, predicted
    published_tps: float

    @property
    def error(self) -> float:
        """predicted / published - 1."""
        return self.predicted / self.published - 1.0


@lru_cache(maxsize=None)
def _table() -> dict:
    return read_toml(rules_dir() / "policy" / "speed_published.toml")


def ratio_tolerance() -> float:
    """The bound |predicted / published - 1| a prediction must stay within ([check] of speed_published.toml)."""
    return float(_table()["check"]["ratio_tolerance"])


def known_misses() -> dict[str, dict]:
    """``{"run.recipe": {"bound": b, "why": text}}``: predictions documented outside the tolerance."""
    return dict(_table()["check"].get("known_miss", {}))


def load_runs() -> dict[str, Run]:
    """Every [run.<name>] of rules/policy/speed_published.toml, its model resolved."""
    data = _table()
    runs = {}
    for name, row in data.get("run", {}).items():
        try:
            model = Shapes(**{k: v for k, v in data["model"][row["model"]].items() if k != "source"})
            runs[name] = Run(name=name, model=model, **{k: (tuple(v) if isinstance(v, list) else v)
                                                        for k, v in row.items() if k != "model"})
        except (KeyError, TypeError) as exc:
            raise RuleError(f"speed_published.toml: [run.{name}] is malformed ({exc})", hint="fix the file")
    if not runs:
        raise RuleError("speed_published.toml: no [run.<name>] tables", hint="fix the file")
    return runs


def _recomputed(run: Run, low: bool) -> set[str]:
    """The block Linears whose forward GEMM activation checkpointing runs again (``low``: in a recipe's format).
    The policy counts aten.mm calls, and torchao's float8 matmul reaches it as aten.mm on its float8 subclass
    (tests/test_plan_step_model.py checks it, eager), so the same matmuls are recomputed as in bf16;
    ``recompute_all_low`` is the what-if that every low-precision forward GEMM is."""
    if run.ac != "selective_op":
        raise UsageError(f"no step model for activation checkpointing {run.ac!r}", hint="use selective_op")
    linears = run.model.block_linears()
    return {lin.name for lin in (linears if low and run.recompute_all_low else linears[1::2])}


def _linear_part(run: Run, recipe: str) -> dict:
    """Seconds of every Linear's GEMMs in one step, split by format (``low``: the recipe's, ``bf16``), and of
    the recipe's cast kernels."""
    m, gpu, shapes = run.tokens, run.gpu, run.model
    casts = None if recipe == "bfloat16" else speed.cast_kernels(recipe)
    recomputed = _recomputed(run, casts is not None)
    low, bf16, kernels, seen_groups = 0.0, 0.0, [], set()
    for lin in shapes.block_linears():
        gemms = [(m, lin.k, lin.n), (m, lin.n, lin.k), (lin.n, m, lin.k)]   # output, grad_input, grad_weight
        fmt = ["bfloat16"] * 3 if casts is None else \
            [casts.gemm_dtype, casts.gemm_dtype, casts.gemm_dtype if casts.low_grad_weight else "bfloat16"]
        if lin.name in recomputed:   # activation checkpointing runs the forward GEMM again
            gemms, fmt = gemms + gemms[:1], fmt + fmt[:1]
        for shape, f in zip(gemms, fmt):
            block = casts.scale_block if casts and f != "bfloat16" else 0
            seconds = speed.gemm_seconds(*shape, gpu, f, achievable=True, scale_block=block)[0]
            low, bf16 = (low, bf16 + seconds) if f == "bfloat16" else (low + seconds, bf16)
        if casts is not None:
            kernels += _cast_kernels(run, recipe, casts, lin, recomputed, seen_groups)
    if "output" not in run.high_precision:
        raise UsageError("the step model keeps the output projection in bf16", hint="list it in high_precision")
    d, v = shapes.dim, shapes.vocab
    output = sum(speed.gemm_seconds(*s, gpu, "bfloat16", achievable=True)[0] for s in ((m, d, v), (m, v, d),
                                                                                        (v, m, d)))
    return {"gemm_low": shapes.layers * low, "gemm_bf16": shapes.layers * bf16 + output,
            "casts": shapes.layers * speed.kernel_seconds(kernels, gpu, achievable=True)}


def _cast_kernels(run: Run, recipe: str, casts: speed.Casts, lin: Linear, recomputed: set[str],
                  seen_groups: set[str]) -> list[float]:
    """Bytes of each cast kernel one block runs for ``lin``."""
    m, linears = run.tokens, run.model.block_linears()
    recast = BF16 + speed.OPERAND_BYTES[casts.gemm_dtype]   # one cast of a bf16 tensor, as AC recomputes it
    kernels = []
    if lin.group not in seen_groups:   # one cast of a shared input (CSE)
        if run.cse:
            seen_groups.add(lin.group)
        kernels += [b * m * lin.k for b in casts.input]
        readers = [o for o in linears if o.group == lin.group] if run.cse else [lin]
        if any(o.name in recomputed for o in readers):
            kernels.append(recast * m * lin.k)
    kernels += [b * m * lin.n for b in casts.grad_output] + speed.rescale_kernels(m, lin.k, lin.n, casts)
    weight = lin.k * lin.n
    if recipe in run.float8_all_gather:   # cast on the fp32 shard before all-gather; bwd: fp8 column-major copy
        kernels += [(FP32 + 1) * weight / run.fsdp] * 2 + [FP32 * weight / run.fsdp, 2 * weight]
    else:
        kernels += [b * weight for b in casts.weight]
        if lin.name in recomputed:
            kernels.append(recast * weight)
    return kernels


def _attention(run: Run) -> float:
    spec = speed.load_gpus()[run.gpu]
    table = speed.attention_rates()
    ref = speed.load_gpus()[table["reference_gpu"]]
    scale = spec["bf16_tflops"] / ref["bf16_tflops"]
    s, d = run.seq_len, run.model.dim
    forward = 4 * s * s * d / 2 * run.local_batch   # FlashAttention's count: 4 s^2 head_dim heads, causal half
    seconds = forward / (table["forward_tflops"] * scale * 1e12)
    seconds += table["backward_flops_ratio"] * forward / (table["backward_tflops"] * scale * 1e12)
    return run.model.layers * seconds


def _compiled_block(d: int, kv: int, f: int) -> list[float]:
    """Bytes per token of each fused kernel torch.compile makes of one block: forward, its recompute under AC,
    backward (torchtitan's Llama: RMSNorm, RoPE, repeat_kv materializing k and v at full width for SDPA, the
    attention output made contiguous, SwiGLU, residual adds)."""
    b = BF16
    forward = [2 * b * d,                    # RMSNorm: read x, write its norm
               2 * b * d + b * (2 * kv + 2 * d) + b * (kv + d),   # RoPE on q; on k and repeat_kv; repeat_kv of v
               2 * b * d,                    # attention output transposed to contiguous
               4 * b * d,                    # residual add + RMSNorm: read x, attention out; write h, its norm
               3 * b * f,                    # SwiGLU: read w1 and w3 outputs, write silu(a) * b
               3 * b * d]                    # residual add
    backward = [4 * b * d,                   # grads of wq, wk, wv summed (3 reads, 1 write)
                4 * b * d,                   # RMSNorm backward + residual grad: read x, grad, grad; write
                4 * b * d + 2 * b * kv,      # RoPE and repeat_kv backward: read grad q, k, v; write q, k, v grads
                2 * b * d,                   # attention output transpose backward
                3 * b * d,                   # grads of w1, w3 summed
                4 * b * d,                   # RMSNorm backward + residual grad
                5 * b * f]                   # SwiGLU backward: read a, b, grad; write grad a, grad b
    return forward * 2 + backward


def _eager_block(d: int, kv: int, f: int) -> list[float]:
    """Bytes per token of each kernel one block runs eagerly, op by op as torchtitan writes them, forward and
    its recompute, then the backward autograd derives (derivatives.yaml: a pointwise op reads its grad and saved
    inputs and writes one grad per input; a grad reaching one tensor twice is summed)."""
    b, w = BF16, FP32
    norm = [(b + w) * d, 2 * w * d, w * d, 2 * w * d, (w + b) * d, 2 * b * d]   # float, pow, mean, mul, type_as, *w
    norm_back = [2 * b * d, (b + w) * d, 2 * w * d, 3 * w * d, 3 * w * d, 3 * w * d, (w + b) * d]
    rope = [(b + w) * x for x in (d, kv)] + [2 * w * x for x in (d, kv)] + [(w + b) * x for x in (d, kv)]
    repeat = [b * (kv + d)] * 2                                                   # repeat_kv of k and v
    forward = norm * 2 + rope + repeat + [2 * b * d, 3 * b * d, 3 * b * d,       # transpose, residual adds
                                          2 * b * f, 3 * b * f]                  # silu, mul
    backward = norm_back * 2 + rope + repeat + [2 * b * d, 3 * b * d, 3 * b * d,   # transpose, residual grads
                                                3 * b * f, 3 * b * f, 3 * b * f,   # silu backward, mul backward
                                                3 * b * d, 3 * b * d, 3 * b * d]   # summed grads of shared inputs
    return forward * 2 + backward


def _pointwise(run: Run, compiled: bool) -> float:
    """The elementwise kernels of one step: the blocks' (fused when compiled), the embedding and the
    cross-entropy in fp32, which torchtitan leaves uncompiled."""
    t, d, kv, f, v = run.tokens, run.model.dim, run.model.kv_dim, run.model.ffn_dim, run.model.vocab
    block = (_compiled_block if compiled else _eager_block)(d, kv, f)
    b = BF16
    head = [2 * b * d * t, 2 * b * d * t,             # embedding forward, final norm
            (b + FP32) * v * t, 2 * FP32 * v * t,     # logits.float(), log_softmax
            FP32 * v * t, 3 * FP32 * v * t, (FP32 + b) * v * t,   # nll backward, log_softmax backward, to bf16
            2 * b * d * t + b * v * d]                # embedding backward into its bf16 gradient
    return speed.kernel_seconds([x * t for x in block] * run.model.layers + head, run.gpu, achievable=True)


def _params(run: Run) -> tuple[int, int]:
    """(parameters of all blocks, of embedding + final norm + output)."""
    shapes = run.model
    return shapes.layers * shapes.block_params(), 2 * shapes.vocab * shapes.dim + shapes.dim


def _optimizer(run: Run) -> float:
    shard = sum(_params(run)) / run.fsdp
    return speed.kernel_seconds([ADAMW_BYTES * shard, CLIP_BYTES * shard], run.gpu, achievable=True)


def _fsdp_copies(run: Run, recipe: str) -> float:
    """FSDP2's copies around its collectives (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)."""
    blocks, root = _params(run)
    lin = run.model.layers * sum(x.k * x.n for x in run.model.block_linears())
    fp8_gather = recipe in run.float8_all_gather
    gathered = blocks + root - (lin if fp8_gather else 0)   # params all-gathered in bf16 (fp8: cast in "casts")
    kernels = [2 * (FP32 + BF16) * gathered / run.fsdp,          # shard -> bf16 all-gather input, twice a step
               2 * 2 * BF16 * gathered,                          # split_with_sizes_copy after each all-gather
               (BF16 + run.reduce_bytes) * (blocks + root)]      # grads into the reduce-scatter input
    if fp8_gather:
        kernels.append(2 * 2 * 1 * lin)                          # fp8 copy-out after each all-gather
    return speed.kernel_seconds(kernels, run.gpu, achievable=True)


def _communication(run: Run, recipe: str, layer_compute: float) -> float:
    spec = speed.load_gpus()[run.gpu]
    link = spec["nvlink_gbps"] / 2 * 1e9               # one direction of a ring
    share = (run.fsdp - 1) / run.fsdp
    lin = sum(x.k * x.n for x in run.model.block_linears())
    gather_bytes = 1 if recipe in run.float8_all_gather else BF16
    gather = share * (lin * gather_bytes + 2 * run.model.dim * BF16) / link
    reduce = share * run.model.block_params() * run.reduce_bytes / link
    exposed = max(0.0, gather - layer_compute / 3) + max(0.0, gather + reduce - 2 * layer_compute / 3)
    _, root = _params(run)
    return run.model.layers * exposed + share * root * (BF16 + run.reduce_bytes) / link


def step_seconds(run: Run, recipe: str, *, compiled: bool | None = None) -> dict:
    """``{"total": s, "parts": {part: s}}`` for one step of ``run`` on one GPU with ``recipe`` ("bfloat16" or a
    recipe name, full or short) for its Linears; ``compiled`` overrides the run's torch.compile (eager: bf16
    only). UsageError where the run's GPU has no native kernels for the recipe."""
    compiled = run.compile if compiled is None else compiled
    if not compiled and recipe != "bfloat16":
        raise UsageError("the step model has no eager low-precision casts", hint="model it compiled")
    if recipe != "bfloat16":
        recipe = speed.require_native(run.gpu, recipe)
    parts = {**_linear_part(run, recipe), "attention": _attention(run), "pointwise": _pointwise(run, compiled),
             "optimizer": _optimizer(run), "fsdp_copies": _fsdp_copies(run, recipe)}
    layer_compute = sum(parts[p] for p in ("gemm_low", "gemm_bf16", "casts", "attention", "pointwise"))
    layer_compute /= run.model.layers
    parts["communication"] = _communication(run, recipe, layer_compute)
    return {"total": sum(parts.values()), "parts": parts}


def compare(run: Run) -> list[Comparison]:
    """Predicted against published speed-up over the run's baseline, for every recipe the run published."""
    base = step_seconds(run, run.baseline)["total"]
    rows = []
    for recipe, tps in run.published.items():
        if recipe == run.baseline:
            continue
        seconds = step_seconds(run, recipe)["total"]
        rows.append(Comparison(run.name, recipe, base / seconds, tps / run.published[run.baseline],
                               run.tokens / seconds, tps))
    if run.published_eager:   # what torch.compile gains over eager, both bf16
        eager = step_seconds(run, "bfloat16", compiled=False)["total"]
        rows.append(Comparison(run.name, "compile_vs_eager", eager / base,
                               run.published[run.baseline] / run.published_eager, run.tokens / base,
                               run.published[run.baseline]))
    return rows
