"""Mixture-of-experts feed-forward block (Flax linen): Switch / GShard / Mixtral routing.

`MoeBlock` replaces `layers.MlpBlock` in the layers a config makes sparse. A router picks each
token's top-k experts; every expert is an MLP of the model's MLP shape (gated or not, the same
activations as `MlpBlock`); the output is the router-weighted sum of the chosen experts' outputs,
plus optional shared experts that every token goes through.

Two dispatch modes:
  - 'capacity' (GShard / Switch): each expert takes at most C tokens of a group (a group is one
    sequence, as in HF Switch: C = ceil(capacity_factor * L * k / E), at least 1, at most L).
    Tokens claim slots in order, first choices of every token before second choices
    (GShard), first come first served within a choice; a token's choice over capacity is dropped
    and contributes 0 (the residual carries the token). Dispatch and combine are one-hot einsums
    [G, S, E, C]; the dispatched activations [E, G, C, D] carry the logical axes
    ('expert', 'expert_group', 'expert_capacity', 'embed'), so the rules alone decide expert
    parallelism: `expert` on a mesh axis the batch is split on turns the dispatch into an
    all-to-all (GShard). Runs everywhere (einsums only).
  - 'dropless' (MegaBlocks / Mixtral): no token is dropped: the (token, choice) pairs are sorted
    by expert and each expert's rows go through one grouped matmul, `jax.lax.ragged_dot(lhs
    [M, D], rhs [E, D, F], group_sizes [E])`. On CPU JAX lowers it to a masked dense batched
    matmul (every expert multiplies every row: E times the work, for tests and small models);
    on GPU and TPU to XLA's ragged dot (`chlo.ragged_dot`; on GPU a Pallas/Triton kernel when
    `jax_ragged_dot_use_gpu_pallas_triton_lowering` is set). Correct under every rules table,
    but the sort is global: GSPMD gathers the tokens (and expert kernels sharded on `expert`),
    so dropless gives no expert parallelism (use 'capacity'), and on Explicit mesh axes JAX
    cannot type the sort (the trainer says so in one line: use shard_mode='auto').

Auxiliary outputs are sown into the 'intermediates' collection (see `MoeStats`; the model adds
the losses to the training loss when that collection is mutable, see models.py).

Shape letters: B=batch, L=length, D=embed, E=expert, F=expert_mlp, K=top_k, G=group (one
sequence), S=tokens per group, C=capacity, T=all tokens (B * L), M=T * K.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from t5lite import constraints
from t5lite.model.config import MOE_DISPATCHES, MOE_ROUTERS, AnyConfig
from t5lite.model.dense import Initializer, default_kernel_init
from t5lite.model.layers import _ACTIVATIONS, MlpBlock

Array = jax.Array
DType = Any

# The names MoeBlock sows into 'intermediates' (one value per MoE layer and call).
AUX_LOSS = "moe_aux_loss"
Z_LOSS = "moe_z_loss"
EXPERT_LOAD = "moe_expert_load"
DROPPED = "moe_dropped_fraction"

DISPATCHED_AXES = ("expert", "expert_group", "expert_capacity", "embed")
HIDDEN_AXES = ("expert", "expert_group", "expert_capacity", "expert_mlp")


def mlp_block(cfg: AnyConfig, sparse: bool, name: str = "mlp") -> nn.Module:
    """The feed-forward block of a layer of `cfg`: a `MoeBlock` where `sparse` (see
    `config.is_moe_layer`), else the dense `MlpBlock`."""
    if not sparse:
        return MlpBlock(
            intermediate_dim=cfg.mlp_dim,
            activations=cfg.mlp_activations,
            dropout_rate=cfg.dropout_rate,
            dtype=cfg.policy.compute,
            param_dtype=cfg.policy.master,
            name=name,
        )
    return MoeBlock(
        num_experts=cfg.num_experts,
        intermediate_dim=cfg.mlp_dim,
        activations=cfg.mlp_activations,
        top_k=cfg.moe_top_k,
        router=cfg.moe_router,
        normalize_top_k=cfg.moe_normalize_top_k,
        jitter_noise=cfg.moe_jitter_noise,
        dispatch=cfg.moe_dispatch,
        capacity_factor=cfg.moe_capacity_factor,
        eval_capacity_factor=cfg.moe_eval_capacity_factor,
        expert_capacity=cfg.moe_expert_capacity,
        num_shared_experts=cfg.moe_shared_experts,
        dropout_rate=cfg.dropout_rate,
        dtype=cfg.policy.compute,
        param_dtype=cfg.policy.master,
        name=name,
    )


@dataclasses.dataclass(frozen=True)
class Routing:
    """A router's decision for T tokens."""

    logits_TE: Array  # fp32 router logits
    probs_TE: Array  # softmax over all experts (the load-balancing loss reads these)
    experts_TK: Array  # int32 chosen experts, best first
    weights_TK: Array  # fp32 combine weights of the chosen experts


def route(
    logits_TE: Array, top_k: int, router: str = "softmax_then_topk", normalize: bool = False
) -> Routing:
    """Top-k routing of fp32 logits.

    'softmax_then_topk' (Switch, Mixtral): softmax over all experts, keep the k largest
    probabilities; `normalize` rescales them to sum to 1 (Mixtral does, Switch does not).
    'topk_then_softmax' (DeepSeek-style / MaxText option): the k largest logits, softmax over
    them only (always normalised).
    """
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    if router == "softmax_then_topk":
        weights_TK, experts_TK = jax.lax.top_k(probs_TE, top_k)
        if normalize:
            weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    elif router == "topk_then_softmax":
        top_logits_TK, experts_TK = jax.lax.top_k(logits_TE, top_k)
        weights_TK = jax.nn.softmax(top_logits_TK, axis=-1)
    else:
        raise ValueError(f"moe router must be one of {MOE_ROUTERS}, got {router!r}")
    return Routing(logits_TE, probs_TE, experts_TK.astype(jnp.int32), weights_TK)


def _token_mean(x_T: Array, valid_T: Array | None) -> Array:
    """Mean over the real tokens (leading axis) of `x_T`; all tokens when `valid_T` is None."""
    if valid_T is None:
        return jnp.mean(x_T, axis=0)
    w_T = valid_T.astype(jnp.float32).reshape((-1,) + (1,) * (x_T.ndim - 1))
    return jnp.sum(x_T * w_T, axis=0) / jnp.maximum(jnp.sum(valid_T.astype(jnp.float32)), 1.0)


def expert_load(experts_TK: Array, num_experts: int, valid_T: Array | None = None) -> Array:
    """[E] fraction of the real tokens' (token, choice) pairs routed to each expert (sums to 1),
    counted before capacity."""
    k = experts_TK.shape[-1]
    return _token_mean(jnp.sum(jax.nn.one_hot(experts_TK, num_experts), axis=1), valid_T) / k


def load_balancing_loss(routing: Routing, num_experts: int, valid_T: Array | None = None) -> Array:
    """Switch/GShard auxiliary loss `E * sum_e f_e * P_e` over the real tokens of the call.

    f_e is the fraction of tokens whose top-k choices include e (counted before capacity, as
    Switch does; for k > 1 the fractions of the k choices are summed, as HF Mixtral does), P_e
    the mean router probability of e. Uniform routing gives k; only P_e carries a gradient.
    `valid_T` (bool [T]) excludes padding from both means, as HF Mixtral's attention mask does.
    """
    f_E = expert_load(routing.experts_TK, num_experts, valid_T) * routing.experts_TK.shape[-1]
    p_E = _token_mean(routing.probs_TE, valid_T)
    return num_experts * jnp.sum(f_E * p_E)


def router_z_loss(logits_TE: Array, valid_T: Array | None = None) -> Array:
    """ST-MoE's router z-loss: mean over the real tokens of logsumexp(logits)^2."""
    return _token_mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)), valid_T)


def expert_capacity(tokens_per_group: int, num_experts: int, top_k: int, factor: float) -> int:
    """Slots per expert and group: ceil(factor * S * k / E), clipped to [1, S]."""
    return max(1, min(tokens_per_group, math.ceil(factor * tokens_per_group * top_k / num_experts)))


def capacity_masks(experts_GSK: Array, weights_GSK: Array, num_experts: int, capacity: int):
    """One-hot dispatch and weighted combine tensors [G, S, E, C] and the kept mask [G, S, K].

    A choice's slot is its position in its expert's queue, where all first choices queue
    before all second choices and, within a choice, tokens queue in order (GShard, Switch).
    """
    g, s, k = experts_GSK.shape
    onehot_GSKE = jax.nn.one_hot(experts_GSK, num_experts, dtype=jnp.int32)
    # Choice-major order: [G, K * S, E], cumulative count per expert gives each queue position.
    queue_GME = onehot_GSKE.transpose(0, 2, 1, 3).reshape(g, k * s, num_experts)
    pos_GME = jnp.cumsum(queue_GME, axis=1) - 1
    pos_GSK = jnp.sum((pos_GME * queue_GME).reshape(g, k, s, num_experts), axis=-1)
    pos_GSK = pos_GSK.transpose(0, 2, 1)
    kept_GSK = pos_GSK < capacity
    slot_GSKC = jax.nn.one_hot(jnp.where(kept_GSK, pos_GSK, capacity), capacity)  # dropped: 0s
    onehot_GSKE = onehot_GSKE.astype(slot_GSKC.dtype)
    dispatch_GSEC = jnp.einsum("gske,gskc->gsec", onehot_GSKE, slot_GSKC)
    combine_GSEC = jnp.einsum("gske,gskc,gsk->gsec", onehot_GSKE, slot_GSKC, weights_GSK)
    return dispatch_GSEC, combine_GSEC, kept_GSK


class MoeBlock(nn.Module):
    """Top-k mixture of expert MLPs: [B, L, D] -> [B, L, D].

    Parameters (logical axes): `router/kernel` [D, E] ('embed', 'expert'); per activation an
    input kernel `wi` (one activation) or `wi_0`, `wi_1`, … [E, D, F] ('expert', 'embed',
    'expert_mlp'); `wo` [E, F, D] ('expert', 'expert_mlp', 'embed'); with shared experts a dense
    `shared_experts` MlpBlock of width `num_shared_experts * intermediate_dim`.

    Attributes:
      num_experts: E.
      intermediate_dim: F, each expert's hidden width.
      activations: as `MlpBlock` (('gelu', 'linear') = gated GELU; ('relu',) = T5.1.0 / Switch).
      top_k: experts per token (1 = Switch, 2 = Mixtral).
      router: 'softmax_then_topk' or 'topk_then_softmax' (see `route`).
      normalize_top_k: rescale the k kept probabilities to sum to 1 (Mixtral; Switch: False).
      jitter_noise: in training, the router input is multiplied by U(1 - eps, 1 + eps)
        (Switch's and HF Mixtral's `router_jitter_noise`); 0 disables it.
      dispatch: 'capacity' or 'dropless' (see the module docstring).
      capacity_factor / eval_capacity_factor: capacity for training / for eval and inference.
      expert_capacity: fixed slots per expert and group for training and eval alike, clipped
        to [1, S] (HF Switch's `expert_capacity`); 0: from the factors.
      num_shared_experts: dense experts every token also goes through (0: none).
    """

    num_experts: int
    intermediate_dim: int
    activations: Sequence[str] = ("gelu", "linear")
    top_k: int = 1
    router: str = "softmax_then_topk"
    normalize_top_k: bool = False
    jitter_noise: float = 0.0
    dispatch: str = "capacity"
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    expert_capacity: int = 0
    num_shared_experts: int = 0
    dropout_rate: float = 0.0
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    kernel_init: Initializer = default_kernel_init

    @nn.compact
    def __call__(
        self, x_BLD: Array, deterministic: bool = True, valid_BL: Array | None = None
    ) -> Array:
        """[B, L, D] -> [B, L, D]; sows the losses and loads into 'intermediates'.

        `valid_BL` (bool, None: every token real) marks the real tokens: padding still goes
        through the router and the experts (the output is unchanged), but the losses, the expert
        load and the dropped fraction are means over the real tokens only.
        """
        for act in self.activations:
            if act not in _ACTIVATIONS:
                raise ValueError(f"unknown activation {act!r}; known: {sorted(_ACTIVATIONS)}")
        b, length, d = x_BLD.shape
        x_BLD = constraints.constrain(x_BLD, ("batch", "length", "embed"))
        routing = Router(
            self.num_experts,
            self.top_k,
            self.router,
            self.normalize_top_k,
            self.jitter_noise,
            self.kernel_init,
            self.param_dtype,
            name="router",
        )(x_BLD.reshape(b * length, d), deterministic)
        names = (
            ["wi"]
            if len(self.activations) == 1
            else [f"wi_{i}" for i in range(len(self.activations))]
        )
        e, f = self.num_experts, self.intermediate_dim
        wi_EDF = [self._kernel(n, (e, d, f), ("expert", "embed", "expert_mlp")) for n in names]
        wo_EFD = self._kernel("wo", (e, f, d), ("expert", "expert_mlp", "embed"))
        experts = functools.partial(self._experts, wi_EDF, wo_EFD, deterministic=deterministic)
        valid_T = None if valid_BL is None else valid_BL.reshape(b * length)
        if self.dispatch == "capacity":
            factor = self.eval_capacity_factor if deterministic else self.capacity_factor
            y_BLD, kept_GSK = self._capacity(x_BLD, routing, experts, factor)
            dropped = 1.0 - jnp.mean(_token_mean(kept_GSK.reshape(b * length, -1), valid_T))
        elif self.dispatch == "dropless":
            y_BLD, dropped = self._dropless(x_BLD, routing, wi_EDF, wo_EFD, deterministic)
        else:
            raise ValueError(f"moe dispatch must be one of {MOE_DISPATCHES}, got {self.dispatch!r}")
        if self.num_shared_experts:
            y_BLD = y_BLD + MlpBlock(
                self.num_shared_experts * f,
                self.activations,
                self.dropout_rate,
                self.dtype,
                self.param_dtype,
                self.kernel_init,
                name="shared_experts",
            )(x_BLD, deterministic=deterministic)
        self.sow("intermediates", AUX_LOSS, load_balancing_loss(routing, e, valid_T))
        self.sow("intermediates", Z_LOSS, router_z_loss(routing.logits_TE, valid_T))
        self.sow("intermediates", EXPERT_LOAD, expert_load(routing.experts_TK, e, valid_T))
        self.sow("intermediates", DROPPED, dropped)
        return constraints.constrain(y_BLD.astype(self.dtype), ("batch", "length", "embed"))

    def _kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> Array:
        # Each expert's [in, out] kernel initialised as a dense layer's (fan-in excludes E).
        def init(key: Array, shape: tuple[int, ...], dtype: DType) -> Array:
            keys = jax.random.split(key, shape[0])
            return jax.vmap(lambda k: self.kernel_init(k, shape[1:], dtype))(keys)

        boxed = nn.with_logical_partitioning(init, axes)
        kernel = self.param(name, boxed, shape, self.param_dtype)
        return constraints.weight(jnp.asarray(kernel, self.dtype))

    def _hidden(self, h: Array, deterministic: bool, axes: tuple[str, ...] | None) -> Array:
        """Product of the activations of the per-activation hidden arrays, then dropout."""
        h = functools.reduce(
            jnp.multiply, [_ACTIVATIONS[a](y) for a, y in zip(self.activations, h)]
        )
        h = nn.Dropout(rate=self.dropout_rate)(h, deterministic=deterministic)
        return h if axes is None else constraints.constrain(h, axes)

    def _experts(
        self, wi_EDF: list[Array], wo_EFD: Array, x_EGCD: Array, deterministic: bool
    ) -> Array:
        """Every expert's MLP on its slots: [E, G, C, D] -> [E, G, C, D]."""
        x_EGCD = constraints.constrain(x_EGCD.astype(self.dtype), DISPATCHED_AXES)
        hs = [constraints.einsum("egcd,edf->egcf", x_EGCD, w) for w in wi_EDF]
        h_EGCF = self._hidden(hs, deterministic, HIDDEN_AXES)
        y_EGCD = constraints.einsum("egcf,efd->egcd", h_EGCF, wo_EFD)
        return constraints.constrain(y_EGCD, DISPATCHED_AXES)

    def _capacity(self, x_BLD: Array, routing: Routing, experts: Any, factor: float):
        """GShard/Switch dispatch with one group per sequence; returns (y, kept [G, S, K])."""
        b, length, _ = x_BLD.shape
        k, e = self.top_k, self.num_experts
        if self.expert_capacity > 0:
            capacity = max(1, min(length, self.expert_capacity))
        else:
            capacity = expert_capacity(length, e, k, factor)
        dispatch_GSEC, combine_GSEC, kept_GSK = capacity_masks(
            routing.experts_TK.reshape(b, length, k),
            routing.weights_TK.reshape(b, length, k),
            e,
            capacity,
        )
        # [G, S, D] -> [E, G, C, D]: with `expert` and `batch` on one mesh axis, an all-to-all.
        x_EGCD = constraints.einsum(
            "gsec,gsd->egcd", dispatch_GSEC.astype(self.dtype), x_BLD.astype(self.dtype)
        )
        y_EGCD = experts(x_EGCD)
        y_BLD = constraints.einsum("gsec,egcd->gsd", combine_GSEC.astype(self.dtype), y_EGCD)
        return y_BLD, kept_GSK.astype(jnp.float32)

    def _dropless(
        self,
        x_BLD: Array,
        routing: Routing,
        wi_EDF: list[Array],
        wo_EFD: Array,
        deterministic: bool,
    ):
        """Every (token, choice) through its expert: sort by expert, grouped matmuls."""
        b, length, d = x_BLD.shape
        t, k, e = b * length, self.top_k, self.num_experts
        experts_M = routing.experts_TK.reshape(t * k)
        order_M = jnp.argsort(experts_M, stable=True)
        x_MD = x_BLD.reshape(t, d).astype(self.dtype)[order_M // k]
        sizes_E = jnp.bincount(experts_M, length=e).astype(jnp.int32)
        hs = [jax.lax.ragged_dot(x_MD, w, sizes_E) for w in wi_EDF]
        h_MF = self._hidden(hs, deterministic, None)
        y_MD = jax.lax.ragged_dot(h_MF, wo_EFD, sizes_E)
        y_TKD = y_MD[jnp.argsort(order_M)].reshape(t, k, d)
        y_TD = jnp.einsum("tkd,tk->td", y_TKD, routing.weights_TK.astype(self.dtype))
        return y_TD.reshape(b, length, d), jnp.zeros([], jnp.float32)


class Router(nn.Module):
    """fp32 router: `kernel` [D, E] ('embed', 'expert'), no bias; [T, D] -> `Routing`."""

    num_experts: int
    top_k: int
    router: str
    normalize_top_k: bool
    jitter_noise: float
    kernel_init: Initializer
    param_dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x_TD: Array, deterministic: bool) -> Routing:
        x_TD = x_TD.astype(jnp.float32)  # NOTE: routing in fp32 (Switch's selective precision)
        if self.jitter_noise > 0.0 and not deterministic:
            eps = self.jitter_noise
            noise_TD = jax.random.uniform(
                self.make_rng("dropout"), x_TD.shape, jnp.float32, 1.0 - eps, 1.0 + eps
            )
            x_TD = x_TD * noise_TD
        init = nn.with_logical_partitioning(self.kernel_init, ("embed", "expert"))
        shape = (x_TD.shape[-1], self.num_experts)
        kernel_DE = self.param("kernel", init, shape, self.param_dtype)
        logits_TE = x_TD @ constraints.weight(jnp.asarray(kernel_DE, jnp.float32))
        return route(logits_TE, self.top_k, self.router, self.normalize_top_k)


@dataclasses.dataclass(frozen=True)
class MoeStats:
    """What the MoE layers of one forward pass sowed, each a mean over the MoE layers."""

    aux_loss: Array  # Switch load-balancing loss
    z_loss: Array  # router z-loss
    dropped_fraction: Array  # real (token, choice) pairs over capacity ('dropless': 0)
    load_imbalance: Array  # max over experts of the expert load / its mean (1: balanced)
    layer_loads: dict[str, Array]  # per MoE layer ('decoder/layers_1'): its expert load [E]


def _sown(intermediates: Any, name: str) -> dict[str, Array]:
    """Each MoE layer's value of `name`, keyed by the layer's path; a scanned stack's stacked
    values are split into `layers_{i}`; several calls of a layer are averaged."""
    found: dict[str, Array] = {}

    def visit(tree: Any, path: tuple[str, ...]) -> None:
        if not isinstance(tree, dict):
            return
        for key, sub in tree.items():
            if key != name:
                visit(sub, (*path, key))
                continue
            value = jnp.mean(jnp.stack([jnp.asarray(v) for v in sub]), axis=0)
            layer = "/".join(p for p in path if p != "mlp")
            if path and "layers" in path:  # scanned: one value per layer on the leading axis
                for i in range(value.shape[0]):
                    found[layer.replace("layers", f"layers_{i}", 1)] = value[i]
            else:
                found[layer] = value

    visit(intermediates, ())
    return found


def collect_stats(intermediates: Any) -> MoeStats | None:
    """The `MoeStats` of a forward pass's 'intermediates' collection (None: no MoE layer)."""
    loads = _sown(intermediates, EXPERT_LOAD)
    if not loads:
        return None

    def mean(name: str) -> Array:
        return jnp.mean(jnp.stack(list(_sown(intermediates, name).values())))

    # Each load sums to 1 over the experts: max / mean = E * max.
    imbalance = jnp.mean(jnp.stack([v.shape[-1] * jnp.max(v) for v in loads.values()]))
    return MoeStats(mean(AUX_LOSS), mean(Z_LOSS), mean(DROPPED), imbalance, loads)


def layer_metrics(stats: MoeStats) -> dict[str, Array]:
    """Per-layer metrics: `moe/<layer>/load_e<i>` (fraction of the choices that went to expert
    i) and `moe/<layer>/load_max_over_mean`."""
    out: dict[str, Array] = {}
    for layer, load_E in stats.layer_loads.items():
        for i in range(load_E.shape[-1]):
            out[f"moe/{layer}/load_e{i}"] = load_E[i]
        out[f"moe/{layer}/load_max_over_mean"] = load_E.shape[-1] * jnp.max(load_E)
    return out
