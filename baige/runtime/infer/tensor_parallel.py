"""Megatron-style tensor parallelism for serving, as a transformation of the plain model.

:func:`shard_model` turns one rank's full :class:`~baige.runtime.model.transformer.Transformer` into
its shard, in place (Shoeybi et al. 2019, "Megatron-LM", section 3; vLLM's ``ColumnParallelLinear`` /
``RowParallelLinear`` / ``VocabParallelEmbedding`` split the same way):

- attention: ``q_proj`` / ``k_proj`` / ``v_proj`` column-parallel by heads (rank r keeps query heads
  ``[r H/N, (r+1) H/N)``), ``o_proj`` row-parallel followed by one all-reduce. KV heads split
  ``n_kv/N`` per rank; with fewer KV heads than ranks each KV head is replicated on the
  ``N / n_kv`` ranks whose query heads read it (GQA groups stay whole).
- dense MLP: ``gate_proj`` / ``up_proj`` column-parallel, ``down_proj`` row-parallel + all-reduce.
- MoE: every routed expert's intermediate dimension split like a dense MLP (the shared expert too),
  one all-reduce after the block; or, with ``expert_parallel``, whole experts placed on ranks
  (``E // N`` each, the first ``E % N`` ranks one more): every rank routes all tokens (the router is replicated), runs
  only the (token,
  expert) pairs of its own experts, and the block's output is summed by the same all-reduce.
- ``embed_tokens`` vocab-parallel (each rank looks up its vocabulary rows, zeros elsewhere, then
  all-reduce) and ``lm_head`` vocab-parallel (each rank's logits gathered on rank 0 and
  concatenated); a tied head shares the embedding's shard.

Norms, rotary tables, routers and biases of row-parallel layers stay whole (a row-parallel bias is
added once, on rank 0). Parameter names do not change, so a rank's ``state_dict`` is its slice of
the checkpoint. Linears may be ``nn.Linear`` or :class:`~baige.runtime.quant.linear.QuantizedLinear`
(int8 per channel, int4 with whole groups per rank). Collectives run on a :class:`Comm`: one
engine's own process group (gloo on CPU, NCCL on GPU), never torch.distributed's default group, so
several tensor-parallel engines can live in one process (``baige bench compare``) and baige can run
inside a user's own distributed job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.moe import Experts, SparseMoeBlock, SwiGLU
from baige.runtime.model.transformer import Transformer
from baige.runtime.quant.linear import QuantizedLinear


def _split(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise BaigeError(f"--tensor-parallel-size {world_size} does not divide {what} ({total})")
    return total // world_size


def check_shardable(cfg: ModelConfig, world_size: int, expert_parallel: bool = False) -> None:
    """Raise BaigeError (one line naming the dimension) when a model of ``cfg`` cannot split over
    ``world_size`` ranks: query heads, KV heads (a multiple of the ranks or a divisor of them), the
    dense, routed (unless ``expert_parallel``) and shared intermediate sizes. Reads only the config,
    so it runs before any worker starts."""
    if cfg.mla is not None and world_size > 1:
        raise BaigeError(
            f"--tensor-parallel-size {world_size}: {cfg.model_type} (Multi-head Latent Attention) runs on one rank"
        )
    _split(cfg.num_attention_heads, world_size, "num_attention_heads")
    k = cfg.num_key_value_heads
    if k % world_size and world_size % k:
        raise BaigeError(
            f"--tensor-parallel-size {world_size}: num_key_value_heads ({k}) must be a multiple or a divisor of it"
        )
    sparse = [cfg.moe is not None and cfg.moe.is_sparse(i) for i in range(cfg.num_hidden_layers)]
    if not all(sparse):
        _split(cfg.intermediate_size, world_size, "intermediate_size")
    if any(sparse):
        if not expert_parallel:
            _split(cfg.moe.intermediate_size, world_size, "moe_intermediate_size")
        if cfg.moe.shared_intermediate_size:
            _split(cfg.moe.shared_intermediate_size, world_size, "shared_expert_intermediate_size")


def _narrow(m: nn.Module, dim: int, start: int, length: int) -> nn.Module:
    """Rows (dim 0) or columns (dim 1) ``[start, start + length)`` of a Linear or QuantizedLinear."""
    if isinstance(m, QuantizedLinear):
        return m.narrow(dim, start, length)
    if not isinstance(m, nn.Linear):
        raise BaigeError(f"tensor parallelism cannot split a {type(m).__name__}")
    w = m.weight.detach().narrow(dim, start, length)
    out = nn.Linear(w.shape[1], w.shape[0], bias=m.bias is not None, device="meta")
    out.weight = nn.Parameter(w.clone(), requires_grad=False)
    if m.bias is not None:
        b = m.bias.detach()
        out.bias = nn.Parameter((b.narrow(0, start, length) if dim == 0 else b).clone(), requires_grad=False)
    return out


class Comm:
    """The collectives a shard needs, on one process group ``pg`` (a ``torch.distributed``
    ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` built for this engine) of which this process is
    ``rank`` of ``world_size``."""

    def __init__(self, pg, rank: int, world_size: int):
        self.pg, self.rank, self.world_size = pg, rank, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        self.pg.allreduce([t]).wait()
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape on all), in rank order, on rank 0; None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        self.pg.gather([parts] if parts is not None else [], [t], opts).wait()
        return parts

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()
        return t


class _AllReduce:
    """Forward hook: sum a module's output over the ranks (after a row-parallel layer)."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(output)


def _row_parallel(m: nn.Module, start: int, length: int, rank: int) -> nn.Module:
    try:
        out = _narrow(m, 1, start, length)
    except BaigeError as e:
        raise BaigeError(f"this checkpoint cannot be tensor-parallel: {e}") from None
    if rank and getattr(out, "bias", None) is not None:
        out.bias.data.zero_()  # the bias is added once, by rank 0's partial sum
    return out


def _shard_swiglu(mlp: SwiGLU, rank: int, world_size: int, comm: Comm | None) -> None:
    """Split a SwiGLU over the ranks; with ``comm``, its down_proj's output is all-reduced."""
    n = mlp.gate_proj.out_features // world_size
    mlp.gate_proj = _narrow(mlp.gate_proj, 0, rank * n, n)
    mlp.up_proj = _narrow(mlp.up_proj, 0, rank * n, n)
    mlp.down_proj = _row_parallel(mlp.down_proj, rank * n, n, rank)
    if comm is not None:
        mlp.down_proj.register_forward_hook(_AllReduce(comm))


class LocalExperts(nn.Module):
    """Expert parallelism: experts ``[first, first + count)`` of a layer's ``E`` (the same
    parameter names as :class:`~baige.runtime.model.moe.Experts`, holding only this rank's rows).

    Forward takes every token's routing over all ``E`` experts and runs only the (token, expert)
    pairs routed here, as one grouped ``kernels.fused_moe`` call with top-1 per pair; the partial
    sums of all ranks add up to the layer's output (the block's all-reduce).
    """

    def __init__(self, experts: Experts, first: int, count: int):
        super().__init__()
        self.first, self.num_experts, self.intermediate_size = first, count, experts.intermediate_size
        self.gate_up_proj = nn.Parameter(
            experts.gate_up_proj.detach()[first : first + count].clone(), requires_grad=False
        )
        self.down_proj = nn.Parameter(experts.down_proj.detach()[first : first + count].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: (N, H); topk_weights (N, k) fp32; topk_ids (N, k) int64 over all experts -> (N, H)."""
        local = (topk_ids >= self.first) & (topk_ids < self.first + self.num_experts)  # (N, k)
        tok, slot = local.nonzero(as_tuple=True)  # (P,) each: the pairs routed to this rank
        out = torch.zeros_like(x)
        if tok.numel():
            y = kernels.fused_moe(
                x[tok],
                self.gate_up_proj,
                self.down_proj,
                topk_weights[tok, slot][:, None],
                (topk_ids[tok, slot] - self.first)[:, None],
            )  # (P, H)
            out.index_add_(0, tok, y)
        return out


def _shard_moe(mlp: SparseMoeBlock, comm: Comm, expert_parallel: bool) -> None:
    rank, world_size = comm.rank, comm.world_size
    ex = mlp.experts
    if expert_parallel:  # E // N each, the first E % N ranks one more
        per, extra = divmod(ex.num_experts, world_size)
        mlp.experts = LocalExperts(ex, rank * per + min(rank, extra), per + (rank < extra))
    else:
        i, n = ex.intermediate_size, ex.intermediate_size // world_size
        gu = ex.gate_up_proj.detach()  # (E, 2I, H): gate rows [0, I), up rows [I, 2I)
        ex.gate_up_proj = nn.Parameter(
            torch.cat([gu[:, rank * n : (rank + 1) * n], gu[:, i + rank * n : i + (rank + 1) * n]], dim=1).contiguous(),
            requires_grad=False,
        )  # (E, 2n, H)
        ex.down_proj = nn.Parameter(
            ex.down_proj.detach()[:, :, rank * n : (rank + 1) * n].contiguous(), requires_grad=False
        )  # (E, H, n)
        ex.intermediate_size = n
    for shared in (mlp.shared_expert, mlp.shared_experts):
        if shared is not None:  # partial sums (the gate scales each rank's share), reduced with the block
            _shard_swiglu(shared, rank, world_size, None)
    mlp.register_forward_hook(_AllReduce(comm))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the embedding table: ids elsewhere look up zeros, and the all-reduce
    adds the one rank that holds each id. ``weight``: (end - start, hidden)."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end, self.comm = start, start + weight.shape[0], comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (B, T) int64 -> (B, T, hidden)."""
        here = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(here, ids - self.start, 0), self.weight)  # (B, T, hidden)
        return self.comm.all_reduce(out * here[..., None].to(out.dtype))


class VocabParallelHead(nn.Module):
    """``lm_head`` over vocabulary rows ``[start, start + n)`` per rank (``proj``, a Linear or
    QuantizedLinear shard); rank 0 receives every rank's logits and concatenates them, the other
    ranks return their own slice (their callers discard it).

    Args:
        proj: this rank's shard; sizes: every rank's row count, in rank order.
    """

    def __init__(self, proj: nn.Module, sizes: list[int], comm: Comm):
        super().__init__()
        self.proj, self.sizes, self.comm = proj, sizes, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab) on rank 0 (this rank's (..., n) slice elsewhere)."""
        local = self.proj(hidden)
        width = max(self.sizes)
        parts = self.comm.gather(F.pad(local, (0, width - local.shape[-1])).contiguous())  # equal sizes
        if parts is None:
            return local
        return torch.cat([p[..., :n] for p, n in zip(parts, self.sizes)], dim=-1)


def vocab_ranges(vocab_size: int, world_size: int) -> list[tuple[int, int]]:
    """Per rank its vocabulary rows ``(start, count)``: ``ceil(V / N)`` each, the last rank the rest."""
    per = -(-vocab_size // world_size)
    return [(min(r * per, vocab_size), max(0, min(per, vocab_size - r * per))) for r in range(world_size)]


@torch.no_grad()
def shard_model(model: Transformer, comm: Comm, expert_parallel: bool = False) -> None:
    """Turn ``model`` (every rank holding the full weights) into rank ``comm.rank``'s shard, in place
    (module docstring). ``model.config`` keeps the full model's sizes; the attention modules'
    ``n_heads`` / ``n_kv_heads`` become the rank's own. Raises BaigeError as :func:`check_shardable`,
    for quantized MoE experts, and for int4 groups a rank would split."""
    cfg, rank, world_size = model.config, comm.rank, comm.world_size
    check_shardable(cfg, world_size, expert_parallel)
    if any(
        isinstance(layer.mlp, SparseMoeBlock) and not isinstance(layer.mlp.experts, Experts)
        for layer in model.model.layers
    ):
        raise BaigeError(
            "tensor-parallel serving of quantized MoE experts is not supported; serve the float "
            "checkpoint or use --tensor-parallel-size 1"
        )
    for layer in model.model.layers:
        attn = layer.self_attn
        H, K, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        h = H // world_size
        kh, k0 = (K // world_size, rank * (K // world_size)) if K >= world_size else (1, rank // (world_size // K))
        attn.q_proj = _narrow(attn.q_proj, 0, rank * h * D, h * D)
        attn.k_proj = _narrow(attn.k_proj, 0, k0 * D, kh * D)
        attn.v_proj = _narrow(attn.v_proj, 0, k0 * D, kh * D)
        attn.o_proj = _row_parallel(attn.o_proj, rank * h * D, h * D, rank)
        attn.o_proj.register_forward_hook(_AllReduce(comm))
        attn.n_heads, attn.n_kv_heads = h, kh
        if isinstance(layer.mlp, SwiGLU):
            _shard_swiglu(layer.mlp, rank, world_size, comm)
        else:
            _shard_moe(layer.mlp, comm, expert_parallel)
    ranges = vocab_ranges(cfg.vocab_size, world_size)
    start, n = ranges[rank]
    emb = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(emb.weight.detach()[start : start + n].clone(), start, comm)
    if cfg.tie_word_embeddings:
        proj = nn.Linear(cfg.hidden_size, n, bias=False, device="meta")
        proj.weight = model.model.embed_tokens.weight
    else:
        proj = _narrow(model.lm_head, 0, start, n)
    model.lm_head = VocabParallelHead(proj, [c for _, c in ranges], comm)
