"""Context parallelism (the ViT's): each rank of the "cp" mesh dimension holds one latitude band of tokens.
(SwinIR's cp is domain parallelism, a band of the field itself: utils/parallel/domain_parallel.py; ``apply_cp`` picks
by the model's plan.)

Applied from outside, with hooks, to a plain model whose plan says where its tokens are (models.spec.TokenPlan: the
token grid, the first block, the modules whose outputs are gathered), after tensor parallelism, before activation
checkpointing, compile and FSDP2:

- before the first block, each cp rank keeps the rows of patch tokens of its band (whole rows of
  the token grid: a latitude band; uneven splits allowed, e.g. 45 rows over 2 ranks = 23 + 22);
- every attention keeps its local queries and all-gathers the keys and values of all bands
  (``gather_tokens``); in backward, the key/value gradients are reduce-scattered back, because
  the queries of every band used this band's keys;
- after the head, the bands are all-gathered again, so every cp rank unpatchifies and computes the
  loss on the whole field, as one device does.

The gradients: every parameter of a cp rank then holds its band's contribution times cp (the
final gather's backward sums the cp identical output gradients), so the data-parallel average
over dp x cp that FSDP2 performs when cp is folded into its mesh gives exactly the
single-device gradient, for every parameter: the norms, the position embedding and the head
included (NERSC's DL4SCI25 code missed the final norm's reduction over cp).

Hand-written because PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` needs
a CUDA SDPA kernel (its backward raises on CPU), and balances load for causal attention only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from utils.config import ConfigError
from utils.parallel.domain_parallel import apply_domain_parallel
from utils.parallel.plans import FieldPlan, TokenPlan, missing_plan, model_plan

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    "cp": ("train_mp.py", "estimate_memory.py"),  # and domain_parallel.py's bands
}


def band_rows(rows: int, cp: int) -> list[int]:
    """Token rows per cp rank: as even as possible, the larger bands first (45 over 2 -> [23, 22])."""
    if cp > rows:
        raise ConfigError(f"cp {cp} is larger than the {rows} rows of patch tokens: each cp rank needs at least "
                          f"one row; use --cp {rows} or fewer (or smaller patches)")
    return [rows // cp + (r < rows % cp) for r in range(cp)]


def _pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if not missing:
        return x.contiguous()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]  # F.pad counts dimensions from the last
    return F.pad(x, pad).contiguous()


class _GatherTokens(torch.autograd.Function):
    """All-gather along ``dim`` (uneven sizes) forward; sum of every rank's gradient for my part backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        padded = _pad_to(x, dim, max(sizes))  # one length: gloo's and nccl's all_gather both want equal sizes
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim, sizes, group = ctx.dim, ctx.sizes, ctx.group
        longest = max(sizes)
        chunks = [_pad_to(chunk, dim, longest) for chunk in grad.split(sizes, dim)]
        mine = dist.get_rank(group)
        out = torch.empty_like(chunks[mine])
        # The tensor form (chunks stacked along dim 0): gloo has it on every supported torch, while the list
        # form reduce_scatter came to gloo only in torch 2.8 ("ProcessGroupGloo does not support reduce_scatter").
        dist.reduce_scatter_tensor(out, torch.cat(chunks), group=group)
        return out.narrow(dim, 0, sizes[mine]), None, None, None


def gather_tokens(x: torch.Tensor, sizes: list[int], group, dim: int = 1) -> torch.Tensor:
    """The tokens of all cp ranks, in band order; differentiable (gradients summed back to their band)."""
    return _GatherTokens.apply(x, dim, sizes, group)


def apply_cp(model: nn.Module, cp_mesh) -> nn.Module:
    """Split the ViT's tokens into latitude bands over ``cp_mesh`` (1-D), or SwinIR's fields (domain
    parallelism); returns the model, hooked in place. A cp mesh of size 1 changes nothing.
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        return model
    plan = model_plan(model).cp
    if isinstance(plan, FieldPlan):
        return apply_domain_parallel(model, cp_mesh)
    if not isinstance(plan, TokenPlan):
        raise missing_plan(model, "context-parallel (cp: TokenPlan or FieldPlan)", "--cp 1")
    rows, cols = plan.grid(model)
    sizes = [r * cols for r in band_rows(rows, cp_mesh.size())]
    rank, group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    start = sum(sizes[:rank])

    def keep_my_band(_module, args):
        (x, *rest) = args
        if x.shape[1] != sum(sizes):  # activation checkpointing recomputes the block from the band itself
            return None
        return (x.narrow(1, start, sizes[rank]), *rest)

    def gather(_module, _args, output):
        return gather_tokens(output, sizes, group)

    # prepend: the band is cut before tensor parallelism's own input hook turns x into a DTensor.
    plan.first(model).register_forward_pre_hook(keep_my_band, prepend=True)
    for module in plan.gathered(model):  # after tensor parallelism's hooks: local tensors
        module.register_forward_hook(gather)
    return model
