"""Train and eval steps: partitioned, donated, microbatched, deterministic.

The `Trainer` turns a model (loss over a batch), an optimizer definition and a `Partitioner`
into three jitted functions with explicit shardings: `init` (state born sharded), `train_step`
(donates the state) and `eval_step`. Batch features carry the logical axes ('batch', 'length').
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta
from jax.sharding import PartitionSpec

from seqio_lite.feature_converters import complete_features
from t5lite.model import optimizers, pipeline
from t5lite.model.models import FEATURE_AXES, BaseModel
from t5lite.partitioning import Partitioner, logical_axes_of
from t5lite.pytree import finite_by_array, path_str

PyTree = Any
Array = jax.Array


def _abstract_init(model: BaseModel, batch: tuple, seed: int) -> Any:
    """`eval_shape` of `model.init` (boxed with logical axes), traced once per model and batch.

    Tracing a full-size model's init takes seconds, and `t5lite plan` builds one trainer per
    layout: the remat policy changes no parameter, so it is left out of the key.
    """
    cfg = getattr(model, "network_config", None)
    if dataclasses.is_dataclass(cfg) and getattr(cfg, "remat_policy", "none") != "none":
        model = dataclasses.replace(
            model, network_config=dataclasses.replace(cfg, remat_policy="none")
        )
    try:
        return _abstract_init_cached(model, batch, seed)
    except TypeError:  # an unhashable model (e.g. a field holding a list): no cache
        return _abstract_init_cached.__wrapped__(model, batch, seed)


@functools.lru_cache(maxsize=4)
def _abstract_init_cached(model: BaseModel, batch: tuple, seed: int) -> Any:
    return jax.eval_shape(model.init, jax.random.PRNGKey(seed), dict(batch))


@flax.struct.dataclass
class TrainState:
    """Everything a step updates. The dropout RNG is not stored: it is `fold_in(seed, step)`."""

    step: Array  # int32 scalar: number of updates applied
    params: PyTree
    opt_state: PyTree


UNPACKED_DROPS = ("_segment_ids", "_positions")
"""The features an unpacked batch does without (one example per row: padding says it all)."""


def _dummy_batch(
    model: BaseModel, batch_size: int, lengths: Mapping[str, int], packed: bool
) -> dict[str, np.ndarray]:
    """The model's features for the Trainer's batches, less `UNPACKED_DROPS` when unpacked."""
    dummy = model.dummy_batch(batch_size, lengths)
    return dummy if packed else {k: v for k, v in dummy.items() if not k.endswith(UNPACKED_DROPS)}


def _check_unpacked(batch: Mapping[str, np.ndarray]) -> None:
    """An unpacked Trainer drops segment ids: refuse a batch whose rows hold several examples,
    which would then attend to each other."""
    for name, ids in batch.items():
        if name.endswith("_segment_ids") and np.size(ids) and int(np.max(ids)) > 1:
            raise ValueError(
                f"{name} packs up to {int(np.max(ids))} examples a row, but this Trainer was "
                f"built with packed=False, which reads no segment ids: build it with "
                f"packed=True (DataConfig.pack)"
            )


class Trainer:
    """Builds the partitioned init / train / eval functions for one model on one mesh.

    Args:
      model: the model (loss, metrics, optimizer definition).
      partitioner: mesh + rules.
      batch_size: global batch size (examples per step, all microbatches together).
      lengths: feature lengths, e.g. `{"inputs": 64, "targets": 32}`.
      num_microbatches: gradient accumulation: the batch is split into this many microbatches
        whose gradients are summed in fp32 before one update.
      seed: drives initialisation and dropout (`fold_in(seed, step)`).
      log_grad_norm: add the global gradient norm to the step metrics. None (default): only when
        the optimizer clips by global norm, where the clip computes that very norm and XLA
        shares it. Without clipping it is a pass of its own over every gradient, and the
        gradients it reads can no longer be fused into the optimizer update: measured on CPU
        for T5.1.1-small, +0.92 GB of memory traffic per step (+9%, ~2.5% of the step time).
      packed: whether a row may hold several examples (seqio's `pack`). False: the model
        reads no segment ids or positions, so a row's only mask is its padding, which fused
        attention takes as row lengths; a packed batch's segments are an [L, L] mask that
        cuDNN reads in every block (1.5x the attention time on an H200, docs/performance.md).
        Unpacked, `global_batch` refuses rows that hold several examples.
    """

    def __init__(
        self,
        model: BaseModel,
        partitioner: Partitioner,
        *,
        batch_size: int,
        lengths: Mapping[str, int],
        num_microbatches: int = 1,
        seed: int = 0,
        log_grad_norm: bool | None = None,
        packed: bool = True,
    ):
        if num_microbatches < 1 or batch_size % num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} must divide the batch size {batch_size}"
            )
        partitioner.get_data_layout(batch_size)  # validates batch vs. data-parallel size
        if num_microbatches > 1:
            partitioner.get_data_layout(batch_size // num_microbatches)
        self.model = model
        self.partitioner = partitioner
        self.batch_size = batch_size
        self.lengths = dict(lengths)
        self.num_microbatches = num_microbatches
        self.seed = seed
        if log_grad_norm is None:
            log_grad_norm = bool(getattr(model.optimizer, "clip_norm", None))
        self.log_grad_norm = log_grad_norm
        self._compiled: dict[Any, Any] = {}  # predict/score functions, built on demand

        self.packed = packed
        dummy = _dummy_batch(model, batch_size, self.lengths, packed)
        self.batch_abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in dummy.items()}
        boxed = _abstract_init(model, tuple(sorted(self.batch_abstract.items())), seed)
        self.params_axes = logical_axes_of(boxed)["params"]
        partitioner.check_rule_names(_logical_names(self.params_axes))
        params_abstract = meta.unbox(boxed)["params"]
        self.tx = model.optimizer.create(self.params_axes)
        opt_axes = optimizers.optimizer_state_axes(
            model.optimizer, self.tx, params_abstract, self.params_axes
        )
        self.state_axes = TrainState(
            step=PartitionSpec(), params=self.params_axes, opt_state=opt_axes
        )
        # What `_init_state` would give, without tracing the model a second time.
        self.state_abstract = TrainState(
            jax.ShapeDtypeStruct((), jnp.int32),
            params_abstract,
            jax.eval_shape(self.tx.init, params_abstract),
        )
        self.state_shardings = partitioner.shardings(self.state_abstract, self.state_axes)
        with partitioner.context():  # a pipeline's microbatches, before anything compiles
            pipeline.check_microbatches(
                getattr(model, "network_config", None), batch_size // num_microbatches
            )
        self.batch_shardings = partitioner.shardings(
            self.batch_abstract, {k: PartitionSpec(*FEATURE_AXES) for k in self.batch_abstract}
        )
        self._init = partitioner.partition(
            self._init_state, in_shardings=None, out_shardings=self.state_shardings
        )
        self.train_step = partitioner.partition(
            self._train_step,
            in_shardings=(self.state_shardings, self.batch_shardings),
            out_shardings=(self.state_shardings, None),
            donate_argnums=(0,),
        )
        self.eval_step = partitioner.partition(
            self._eval_step,
            in_shardings=(self.state_shardings.params, self.batch_shardings),
            out_shardings=None,
        )
        batch_typed = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.batch_abstract,
            self.batch_shardings,
        )
        partitioner.check_explicit(
            self.train_step, self.abstract_state(), batch_typed, what="train step"
        )

    # --- state ------------------------------------------------------------------------------

    def _init_state(self, rng: Array) -> TrainState:
        batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in self.batch_abstract.items()}
        params = meta.unbox(self.model.init(rng, batch))["params"]
        return TrainState(jnp.zeros([], jnp.int32), params, self.tx.init(params))

    def init_state(self) -> TrainState:
        """A fresh train state, born sharded (never whole on one device)."""
        return self._init(jax.random.PRNGKey(self.seed))

    def abstract_state(self) -> TrainState:
        """`ShapeDtypeStruct`s with shardings: the restore target of a checkpoint."""
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.state_abstract,
            self.state_shardings,
        )

    # --- steps ------------------------------------------------------------------------------

    def _grads(self, params: PyTree, batch: Mapping[str, Array], rng: Array):
        """Summed-loss gradients over microbatches, divided once by the total normaliser.

        Splitting the loss as numerator / denominator makes k microbatches give exactly the
        gradient of one big batch, whatever the loss normalisation.
        """

        grad_fn = jax.grad(self.model.loss_terms, has_aux=True)
        k = self.num_microbatches
        if k == 1:
            # The denominator depends on the batch only: dividing the loss before
            # differentiating scales the backward pass's seed, instead of every gradient leaf
            # afterwards (XLA materialised `grads / den` as one more pass over all parameters).
            def normalised(p, b, r):
                num, m = self.model.loss_terms(p, b, r)
                den = jax.lax.stop_gradient(m["loss_denominator"])
                return num / jnp.maximum(den, 1.0), m

            return jax.grad(normalised, has_aux=True)(params, batch, rng)
        else:
            # Microbatch i is rows i, i+k, i+2k, ...: each device's contiguous block of the
            # batch holds its share of every microbatch, so splitting moves no data (t5x's
            # contiguous slices made the partitioner shuffle rows between devices every step,
            # and Explicit axes cannot slice a sharded dimension at all). The gradient is a sum
            # over all rows either way.
            mbs = {
                n: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
                for n, x in batch.items()
            }

            def body(carry, i_mb):
                acc, msum = carry
                i, mb = i_mb
                g, m = grad_fn(params, mb, jax.random.fold_in(rng, i))
                acc = jax.tree_util.tree_map(lambda a, b: a + b.astype(jnp.float32), acc, g)
                return (acc, jax.tree_util.tree_map(jnp.add, msum, m)), None

            # zeros_like keeps each parameter's sharding: on Explicit axes the scan's carry
            # must have the type the accumulated gradients come back with.
            zeros = jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, jnp.float32), params)
            m_abstract = jax.eval_shape(
                lambda: grad_fn(params, {n: x[0] for n, x in mbs.items()}, rng)[1]
            )
            m0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), m_abstract)
            (grads, metrics), _ = jax.lax.scan(body, (zeros, m0), (jnp.arange(k), mbs))
            grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
        den = jnp.maximum(metrics["loss_denominator"], 1.0)  # as in BaseModel.loss_fn
        grads = jax.tree_util.tree_map(lambda g: g / den, grads)
        return grads, metrics

    def _train_step(self, state: TrainState, batch: Mapping[str, Array]):
        rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), state.step)
        grads, metrics = self._grads(state.params, batch, rng)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = jax.tree_util.tree_map(jnp.add, state.params, updates)
        metrics = dict(metrics)
        if self.log_grad_norm:
            # optax's norm, op for op: next to `clip_by_global_norm` XLA computes it once.
            metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["learning_rate"] = self.model.optimizer.learning_rate_at(state.step)
        # One boolean per parameter array (reductions fused by XLA with the update that writes
        # them): a non-finite gradient reaches every parameter it touches through the
        # optimizer, and the optimizer's own NaNs are caught too. The train program stops
        # before saving a state with any False, and names the arrays from these flags alone:
        # it reads them a step late, when this step's state has already been donated.
        metrics["params_finite"] = finite_by_array(params)
        return TrainState(state.step + 1, params, opt_state), metrics

    def _eval_step(self, params: PyTree, batch: Mapping[str, Array]):
        return self.model.eval_fn(params, batch)

    # --- prediction and scoring on the trainer's mesh ------------------------------------------

    def predict_fn(self, params: PyTree, decode_len: int) -> Callable[..., list[list[int]]]:
        """A numpy-in, token-lists-out predictor on this mesh (compiled once per length).

        Decodes with the model's KV-cached decoder as its `decoding_method` says. The returned
        `predict_fn(batch, rng_index=0)` samples with `fold_in(PRNGKey(seed), rng_index)`, so a
        batch decodes the same way in every run and on every process; outputs are replicated.
        Each row is cut after its first EOS (kept) or padding id (dropped).
        """
        key = ("predict", decode_len)
        if key not in self._compiled:
            model = self.model
            # Decoding's loop carries change sharding between iterations, which explicit
            # sharding cannot type: in explicit mode it runs on Auto axes (the same program).
            decode = self.partitioner.auto_region(
                lambda p, b, rng: model.predict_batch(p, b, rng, max_decode_length=decode_len),
                out_shardings=None,
            )
            self._compiled[key] = self.partitioner.partition(
                decode,
                in_shardings=(self.state_shardings.params, self.batch_shardings, None),
                out_shardings=None,
            )
        predict = self._compiled[key]

        def predict_fn(batch: Mapping[str, np.ndarray], rng_index: int = 0) -> list[list[int]]:
            rows = len(next(iter(batch.values())))
            rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), rng_index)
            global_batch = self.global_batch_from_full(fit_batch(batch, self.batch_size))
            ids = jax.device_get(predict(params, global_batch, rng))
            eos, pad = self.model.eos_id, self.model.pad_id
            return [_until_eos(r, eos, pad) for r in np.asarray(ids)[:rows]]

        return predict_fn

    def score_fn(self, params: PyTree) -> Callable[[Mapping[str, np.ndarray]], list[float]]:
        """A numpy-in, log-likelihoods-out scorer on this mesh (compiled once)."""
        if "score" not in self._compiled:
            self._compiled["score"] = self.partitioner.partition(
                self.model.score_batch,
                in_shardings=(self.state_shardings.params, self.batch_shardings),
                out_shardings=None,
            )
        score = self._compiled["score"]

        def score_fn(batch: Mapping[str, np.ndarray]) -> list[float]:
            rows = len(next(iter(batch.values())))
            global_batch = self.global_batch_from_full(fit_batch(batch, self.batch_size))
            out = jax.device_get(score(params, global_batch))
            return [float(x) for x in np.asarray(out)[:rows]]

        return score_fn

    # --- data -------------------------------------------------------------------------------

    def global_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, Array]:
        """This process's numpy batch -> global arrays with the batch sharding."""
        if not self.packed:
            _check_unpacked(local_batch)
        # Features a converter does not produce (e.g. no packing) default to what they mean.
        local = complete_features(local_batch, list(self.batch_abstract))
        local = {k: local[k] for k in self.batch_abstract}
        return self.partitioner.host_local_to_global(local, self.batch_size, self.batch_shardings)

    def global_batch_from_full(self, batch: Mapping[str, np.ndarray]) -> dict[str, Array]:
        """Global arrays from a batch every process holds whole (eval / infer): each process
        contributes only its own rows, so every example is computed once."""
        layout = self.partitioner.get_data_layout(self.batch_size)
        return self.global_batch(_rows_of_this_process(batch, layout))


def _logical_names(axes_tree: PyTree) -> set[str]:
    """Every logical axis name in a tree of `PartitionSpec`s of names."""
    names: set[str] = set()
    for spec in jax.tree_util.tree_leaves(
        axes_tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    ):
        for entry in spec if isinstance(spec, PartitionSpec) else ():
            names.update([entry] if isinstance(entry, str) else [e for e in entry or () if e])
    return names


def fit_batch(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Pads (with padding rows) or trims an eval batch to the compiled batch size."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        if v.shape[0] < rows:
            v = np.concatenate([v, np.zeros((rows - v.shape[0], *v.shape[1:]), v.dtype)])
        out[k] = v[:rows]
    return out


def _until_eos(ids: np.ndarray, eos_id: int, pad_id: int) -> list[int]:
    """Token ids up to the first EOS (kept) or padding id (dropped): the model's ids."""
    out = []
    for t in ids.tolist():
        if t == pad_id:
            break
        out.append(t)
        if t == eos_id:
            break
    return out


def _rows_of_this_process(batch, layout):
    """This process's rows of a batch that every process holds in full."""
    lo = layout.shard_id * layout.per_process_batch_size
    return {k: np.asarray(v)[lo : lo + layout.per_process_batch_size] for k, v in batch.items()}


def inexact_leaf_paths(tree: PyTree) -> list[str]:
    """The paths of the floating-point leaves of `tree` (arrays or `ShapeDtypeStruct`s), in
    the order of `finite_by_array`'s flags."""
    return [
        path_str(p)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]


def summarize(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Summable step metrics -> the numbers a person reads."""
    m = {k: float(v) for k, v in metrics.items() if k != "params_finite"}
    w = max(m.get("weight_sum", 0.0), 1e-9)
    out = {
        "loss": m["loss_sum"] / w,
        "z_loss": m.get("z_loss_sum", 0.0) / w,
        "accuracy": m["correct_sum"] / w,
        "target_tokens": m["weight_sum"],
        "sequences": m.get("num_sequences", 0.0),
    }
    for k in ("grad_norm", "learning_rate"):
        if k in m:
            out[k] = m[k]
    # Mixture-of-experts statistics (model/moe.py), summed times weight_sum like loss_sum.
    out.update(
        {
            k[: -len("_sum")]: v / w
            for k, v in m.items()
            if k.startswith("moe") and k.endswith("_sum")
        }
    )
    return out
