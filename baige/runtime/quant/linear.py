"""The quantized module: :class:`QuantizedLinear` (compressed-tensors buffers, see
:mod:`baige.runtime.quant.scheme`), and the helpers that find and swap Linears in a model."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable

import torch
from torch import nn

from baige import kernels
from baige.errors import BaigeError
from baige.kernels import dequantize_weight, unpack_int4
from baige.runtime.quant.scheme import QuantScheme, pack_int4


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored as integers and dequantized inside ``forward``.

    Buffer names and layouts are compressed-tensors' (module docstring), so the module's state
    dict is the on-disk checkpoint. The bias stays a float Parameter, untouched.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        n_groups = scheme.n_groups(in_features)
        kw = dict(device=device)
        if scheme.num_bits == 8:
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, **kw))
        else:
            words = math.ceil(in_features / 8)
            self.register_buffer("weight_packed", torch.zeros(out_features, words, dtype=torch.int32, **kw))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64, **kw))
        self.register_buffer("weight_scale", torch.ones(out_features, n_groups, dtype=dtype, **kw))
        if not scheme.symmetric:
            zp_rows = math.ceil(out_features / 8)
            self.register_buffer("weight_zero_point", torch.zeros(zp_rows, n_groups, dtype=torch.int32, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **kw)) if bias else None

    @classmethod
    def from_quantized(
        cls,
        linear: nn.Linear,
        scheme: QuantScheme,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
    ) -> "QuantizedLinear":
        """Wrap integer weights (from :func:`quantize_weight` or GPTQ) for ``linear``; reuses its bias Parameter."""
        m = cls(linear.in_features, linear.out_features, False, scheme, scale.dtype, device=q.device)
        if scheme.num_bits == 8:
            m.weight = q.contiguous()
        else:
            m.weight_packed = pack_int4(q)
        m.weight_scale = scale.contiguous()
        if zero_point is not None:
            m.weight_zero_point = pack_int4(zero_point.t()).t().contiguous()  # packed along out_features
        m.bias = linear.bias
        return m

    def int_weight(self) -> torch.Tensor:
        """(out, in) int8 quantized values."""
        if self.scheme.num_bits == 8:
            return self.weight
        return unpack_int4(self.weight_packed, self.in_features)

    def zero_point(self) -> torch.Tensor | None:
        """(out, n_groups) int8 zero points, or None when symmetric."""
        if self.scheme.symmetric:
            return None
        return unpack_int4(self.weight_zero_point.t(), self.out_features).t()

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedLinear":
        """A new module holding rows (``dim`` 0: output features) or columns (``dim`` 1: input
        features) ``[start, start + length)`` of this one, with their scales and zero points (the
        shard a tensor-parallel rank keeps). The bias follows the output rows; a column slice keeps
        it whole.

        Raises:
            BaigeError: a column slice of a group-wise scheme that does not start and end on group
                boundaries (a group's scale would be split across two modules).
        """
        q, scale, zp, g = self.int_weight(), self.weight_scale, self.zero_point(), self.scheme.group_size
        bias = self.bias
        if dim == 0:
            q, scale = q[start : start + length], scale[start : start + length]
            zp = None if zp is None else zp[start : start + length]
            bias = None if bias is None else bias[start : start + length]
        else:
            end = start + length
            if g is not None:
                if start % g or (end % g and end != self.in_features):
                    raise BaigeError(
                        f"cannot split in_features={self.in_features} at [{start}, {end}): "
                        f"int4 groups of {g} columns must stay whole on one rank"
                    )
                groups = slice(start // g, -(-end // g))
                scale = scale[:, groups]
                zp = None if zp is None else zp[:, groups]
            q = q[:, start:end]
        out_f, in_f = q.shape
        m = QuantizedLinear(in_f, out_f, False, self.scheme, scale.dtype, device=q.device)
        if self.scheme.num_bits == 8:
            m.weight = q.contiguous()
        else:
            m.weight_packed = pack_int4(q)
        m.weight_scale = scale.contiguous()
        if zp is not None:
            m.weight_zero_point = pack_int4(zp.t()).t().contiguous()
        if bias is not None:
            m.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return m

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) float weight in the scale's dtype."""
        return dequantize_weight(self.int_weight(), self.weight_scale, self.zero_point(), self.scheme.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out): ``F.linear`` with the dequantized weight. When ``x`` needs a gradient
        and the bias does not (a frozen quantized base under LoRA, QLoRA-style), the backward
        dequantizes the weight again instead of keeping it from the forward
        (:class:`_FrozenQuantizedLinear`); the integer weight and its scales never get gradients."""
        qweight = self.weight if self.scheme.num_bits == 8 else self.weight_packed
        frozen_bias = self.bias is None or not self.bias.requires_grad
        if torch.is_grad_enabled() and x.requires_grad and frozen_bias:
            return _FrozenQuantizedLinear.apply(x, self, qweight)
        return kernels.quantized_linear(
            x, qweight, self.weight_scale, self.zero_point(), self.scheme.group_size, self.bias
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``y = x W^T + b`` with the quantized ``W`` dequantized inside the matmul (``kernels.quantized_linear``)
    (the exact kernel: the forward is the product the backward differentiates) and
    ``dL/dx = dL/dy W`` from a weight dequantized again in the backward: nothing of the size of ``W``
    is saved between the two (the memory saving QLoRA relies on, Dettmers et al. 2023). Weight, scales and bias are
    frozen: only ``x`` gets a gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: "QuantizedLinear", qweight: torch.Tensor) -> torch.Tensor:
        ctx.module = module
        with torch.no_grad():
            return kernels.quantized_linear(
                x,
                qweight,
                module.weight_scale,
                module.zero_point(),
                module.scheme.group_size,
                module.bias,
                int_dot=False,
            )

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.module.dequantized_weight().to(grad.dtype)  # (out, in)
        return grad @ w, None, None


def target_linears(
    model: nn.Module, ignore: list[str], rename: Callable[[str], str] | None = None
) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` whose qualified name matches none of the ``ignore`` glob patterns
    (``fnmatch``, e.g. ``lm_head``, ``*.down_proj``, ``model.layers.0.*``), in module order.
    With ``rename`` (baige name -> published name, e.g. Mixtral's ``block_sparse_moe``) a pattern
    matching either name ignores the Linear."""

    def ignored(name: str) -> bool:
        names = (name,) if rename is None else (name, rename(name))
        return any(fnmatch.fnmatchcase(n, p) for n in names for p in ignore)

    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and not ignored(name)]


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def layer_report(name: str, w: torch.Tensor, qlinear: QuantizedLinear) -> dict:
    """One report row: format, shape, relative Frobenius error ``||W - W_hat|| / ||W||`` (unitless)."""
    w_hat = qlinear.dequantized_weight().float()
    w = w.float()
    rel = (torch.linalg.vector_norm(w - w_hat) / torch.linalg.vector_norm(w).clamp_min(1e-30)).item()
    partial = qlinear.scheme.group_size is not None and w.shape[1] % qlinear.scheme.group_size != 0
    return {
        "name": name,
        "format": qlinear.scheme.format,
        "scheme": qlinear.scheme.describe(),
        "shape": list(w.shape),
        "relative_weight_error": rel,
        "partial_last_group": partial,
    }
