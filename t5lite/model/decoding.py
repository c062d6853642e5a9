"""Autoregressive decoding: greedy, temperature sampling (top-k, top-p) and beam search.

Model-agnostic, as t5x's decoding.py: the model supplies a `tokens_to_logits(state)` callback
that feeds `state.cur_token` [B, 1] through its KV cache (`state.cache`) and returns the logits
for the next token [B, V] (or [B, 1, V]) and the updated cache. Everything here runs inside one
`jax.lax.while_loop`, so it jits and partitions like any other step.

Coordinates. `prompt_BL[b, i]` is the token fed to the decoder at position i. Position 0 is the
decoder start slot: it is always fed `decoder_start_token_id` (t5x: 0). Row b starts decoding
at `initial_index[b]` (default 0): its cache already holds positions < initial_index (a prefill,
for decoder-only prompts) and the first token fed is `prompt_BL[b, initial_index[b]]`. Returned
sequences are in *target* coordinates: `sequences[..., j]` is the token at position j + 1 of the
decoder input, so positions j < initial_index hold the prompt (`prompt_BL[b, j + 1]`).

Prompts (t5x semantics). Every prompt token (any id but `pad_id`) that the loop reaches is
forced, with or without `initial_index`: it is written instead of a prediction, adds nothing to
the score and does not end the row even if it is EOS; generation continues after it. A prompt
that cannot be honoured -- one that leaves a row no position to generate (too long for the
length or for `max_decode_steps`), a prompt token in the start slot 0, or an `initial_index`
outside [0, L) -- raises ValueError when the inputs are concrete (not traced). Under `jax.jit`
the values are unknown, so this is not checked there.

Stopping. A row stops after a generated `eos_id` (t5x: 1), at its last position (L - 1, or
`initial_index + max_decode_steps - 1`), or (sampling) once its log-probability falls below
`min_log_prob`. Everything after is `pad_id` (t5x: 0).

Order. Decodes come best first by default: `sequences[:, 0]` is the best, as Hugging Face's
`generate` returns them and as t5lite always did. `order="best_last"` gives t5x's order
(ascending score; t5x users take `decodes[:, -1]`). The two orders are exact reverses, except
that beam search with "best_last" keeps its beams in t5x's order throughout, so that beams of
equal score are kept and returned as t5x keeps and returns them.

Steps. `max_decode_steps` counts positions from `initial_index` by default (forced prompt tokens
count); `max_decode_steps_after_prompt=True` counts them after each row's prompt, as t5x does.
The two agree where decoding starts at the end of the prompt (a prefilled prompt, as the
decoder-only model decodes). `max_decode_steps_hard_limit` (sampling) clips `max_decode_steps`
by a static number, as t5x's does.

The cache is any pytree whose leaves have the batch on axis 0 (t5lite's KV cache does, scanned
or not); for several decodes per example (samples, beams) it is repeated per decode here, so
the model prefills each example once.

Shape letters: B=batch, L=length, V=vocab, N=decodes per example, W=beams, C=2W candidates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from t5lite.model.decode_common import (
    DECODER_START_ID,
    EOS_ID,
    NEG_INF,
    ORDERS,
    PAD_ID,
    DecodingState,
    LogitCallbackFn,
    SamplingLoopState,
    StateCallbackFn,
    TokensToLogits,
    _check_order,
    _forced,
    _logits_BV,
    _ordered,
    _per_row,
    _Start,
    _start,
    brevity_penalty,
    expand_batch,
    filter_logits,
)

# The public decoding API (the shared parts live in `decode_common.py`).
__all__ = [
    "DECODER_START_ID",
    "EOS_ID",
    "NEG_INF",
    "ORDERS",
    "PAD_ID",
    "DecodingState",
    "LogitCallbackFn",
    "SamplingLoopState",
    "StateCallbackFn",
    "TokensToLogits",
    "beam_search",
    "brevity_penalty",
    "expand_batch",
    "filter_logits",
    "greedy",
    "temperature_sample",
]

Array = jax.Array
PyTree = Any


def _token_logp(logits_BV: Array, token_B: Array) -> Array:
    """log_softmax(logits)[b, token_B[b]], [B]."""
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    return jnp.take_along_axis(logp_BV, token_B[:, None].astype(jnp.int32), axis=-1)[:, 0]


def _choose(
    logits_BV: Array,
    key: Array,
    temperature_B: Array,
    top_k: int,
    top_p: float | Array,
    rescale: bool,
) -> tuple[Array, Array]:
    """Next tokens [B] (sampled, or the argmax in rows whose temperature is 0) and their
    log-probabilities [B]: the model's, or (`rescale`, t5x) those of the distribution sampled
    from, 0 in greedy rows."""
    greedy_B = jnp.argmax(logits_BV, axis=-1)
    hot_B = temperature_B > 0.0
    safe_B1 = jnp.where(hot_B, temperature_B, 1.0)[:, None]  # no 0 / 0 in greedy rows
    scaled_BV = filter_logits(logits_BV / safe_B1, top_k, top_p)
    next_B = jnp.where(hot_B, jax.random.categorical(key, scaled_BV), greedy_B)
    if rescale:
        return next_B, jnp.where(hot_B, _token_logp(scaled_BV, next_B), 0.0)
    return next_B, _token_logp(logits_BV, next_B)


def _choose_greedy(logits_BV: Array, rescale: bool) -> tuple[Array, Array]:
    """`_choose` for statically greedy decoding."""
    next_B = jnp.argmax(logits_BV, axis=-1)
    return next_B, jnp.zeros(next_B.shape) if rescale else _token_logp(logits_BV, next_B)


def _sample_step(
    c: SamplingLoopState,
    tokens_to_logits: TokensToLogits,
    choose: Callable[[Array, Array], tuple[Array, Array]],
    start: _Start,
    min_log_prob_B: Array | None,
    eos_id: int,
    pad_id: int,
    state_callback_fn: StateCallbackFn | None,
    logit_callback_fn: LogitCallbackFn | None,
) -> SamplingLoopState:
    """One position of every row: predict (or force the prompt), score, write, maybe stop."""
    if state_callback_fn is not None:
        c = state_callback_fn(c)
    logits, cache = tokens_to_logits(DecodingState(c.cur_index, c.cur_token, c.sequences, c.cache))
    logits_BV = _logits_BV(logits)
    if logit_callback_fn is not None:
        logits_BV = logit_callback_fn(logits_BV, c).astype(jnp.float32)
    prompt_B, forced_B = _forced(start.forced_BL, c.cur_index, pad_id)
    chosen_B, chosen_logp_B = choose(logits_BV, c.step)
    next_B = jnp.where(forced_B, prompt_B, chosen_B)
    ends_B = (next_B == eos_id) & ~forced_B
    if state_callback_fn is not None:  # a token the callback wrote is forced; its EOS ends
        placed_B, by_callback_B = _forced(c.sequences, c.cur_index, pad_id)
        next_B = jnp.where(by_callback_B, placed_B, next_B)
        ends_B = jnp.where(by_callback_B, placed_B == eos_id, ends_B)
        forced_B = forced_B | by_callback_B
    next_B = jnp.where(c.ended, pad_id, next_B).astype(jnp.int32)
    # A token that adds to the score is the chosen one (not forced, row not ended).
    logp_B = c.log_prob + jnp.where(c.ended | forced_B, 0.0, chosen_logp_B)
    at_BL = jnp.arange(c.sequences.shape[1])[None] == c.cur_index[:, None]
    write_BL = at_BL & ~c.ended[:, None]
    sequences_BL = jnp.where(write_BL, next_B[:, None], c.sequences)
    ends_B = ends_B | (c.cur_index >= start.last_B)
    if min_log_prob_B is not None:
        ends_B = ends_B | (logp_B < min_log_prob_B)
    return SamplingLoopState(
        c.step + 1, c.cur_index + 1, next_B[:, None], sequences_BL, cache, c.ended | ends_B, logp_B
    )


def _hard_limited(
    max_decode_steps: int | Array | None, hard_limit: int | None
) -> int | Array | None:
    """t5x's `max_decode_steps_hard_limit`: clips `max_decode_steps` when both are set."""
    if hard_limit is not None and (isinstance(hard_limit, bool) or not isinstance(hard_limit, int)):
        raise ValueError(
            f"max_decode_steps_hard_limit must be a Python int or None (static, as in t5x), got "
            f"{hard_limit!r}"
        )
    if hard_limit is None or hard_limit <= 0 or max_decode_steps is None:
        return max_decode_steps
    if isinstance(max_decode_steps, int):
        return min(max_decode_steps, hard_limit)
    return jnp.minimum(max_decode_steps, hard_limit)


def temperature_sample(
    prompt_BL: Array,
    cache: PyTree,
    tokens_to_logits: TokensToLogits,
    *,
    decode_rng: Array | None = None,
    initial_index: Array | None = None,
    num_decodes: int = 1,
    temperature: float | Array = 1.0,
    top_k: int = 0,
    top_p: float | Array = 1.0,
    min_log_prob: float | Array | None = None,
    max_decode_steps: int | Array | None = None,
    max_decode_steps_after_prompt: bool = False,
    max_decode_steps_hard_limit: int | None = None,
    eos_id: int = EOS_ID,
    pad_id: int = PAD_ID,
    decoder_start_token_id: int = DECODER_START_ID,
    order: str = "best_first",
    state_callback_fn: StateCallbackFn | None = None,
    logit_callback_fn: LogitCallbackFn | None = None,
    rescale_log_probs: bool = False,
) -> tuple[Array, Array]:
    """Samples `num_decodes` continuations per row (greedy where the temperature is 0).

    Args:
      prompt_BL: int decoder inputs [B, L] (see the module docstring); pad_id for no prompt.
      cache: the model's cache for B rows, positions < initial_index filled.
      tokens_to_logits: the model's step function.
      decode_rng: PRNG key for sampling (default PRNGKey(0); unused when greedy).
      initial_index: [B] first position to decode per row (default 0).
      num_decodes: N samples per row (the cache is repeated N times); static.
      temperature: logits are divided by it before sampling; 0 means greedy (argmax). A scalar
        or one per row [B]; may be traced.
      top_k: see `filter_logits`; static (top_k == 1 is greedy).
      top_p: see `filter_logits`; a scalar or [B]; may be traced.
      min_log_prob: a row (each of its samples) stops, as at its length limit, once its
        log-probability (the returned score) falls below this; the token that crossed it is
        kept. None: no limit. A scalar or [B]; may be traced.
      max_decode_steps: at most this many positions per row from `initial_index` (forced prompt
        tokens count); default: up to position L - 1. May be traced.
      max_decode_steps_after_prompt: t5x's count instead: `max_decode_steps` positions after
        each row's prompt (its non-pad tokens), wherever decoding starts; static.
      max_decode_steps_hard_limit: t5x's static bound (a Python int) on a given, maybe traced
        `max_decode_steps`, which becomes the smaller of the two; None or <= 0: no bound.
        Without `max_decode_steps` it does nothing (as in t5x).
      eos_id: decoding of a row stops after generating this token (t5x: 1).
      pad_id: written after a row stops; marks "no prompt token" in `prompt_BL` (t5x: 0).
      decoder_start_token_id: fed at position 0 (t5x: 0).
      order: "best_first" or "best_last" (t5x); see the module docstring.
      state_callback_fn: t5x's hook: called with the `SamplingLoopState` before every step and
        once after the loop; what it returns is the state the loop goes on with (e.g. tokens
        it writes ahead in `sequences` are forced). None: no hook.
      logit_callback_fn: t5x's hook: `(logits [B, V] fp32, state) -> logits`, applied to the
        model's logits at every step before sampling and scoring (`state` as the step starts).
      rescale_log_probs: t5x's scores: the log-probabilities of the distribution sampled from
        (after temperature, top-k and top-p; 0 per greedy token) instead of the model's; static.

    Returns:
      (sequences [B, N, L] int32, log_probs [B, N] fp32): decodes sorted by the model's
      log-probability of the generated tokens (raw logits, before temperature and filtering,
      unless `rescale_log_probs`; forced prompt tokens excluded), in `order`.
    """
    _check_order(order)
    b, length = prompt_BL.shape
    max_decode_steps = _hard_limited(max_decode_steps, max_decode_steps_hard_limit)
    start = _start(
        prompt_BL,
        initial_index,
        max_decode_steps,
        pad_id,
        decoder_start_token_id,
        max_decode_steps_after_prompt,
    )
    temperature_B = _per_row(temperature, b, "temperature")
    # A Python top_p stays static (1.0 skips the nucleus sort); anything else is per row.
    top_p_B = None if isinstance(top_p, int | float) else _per_row(top_p, b, "top_p")
    min_log_prob_B = None if min_log_prob is None else _per_row(min_log_prob, b, "min_log_prob")
    start, temperature_B, top_p_B, min_log_prob_B, cache = expand_batch(
        (start, temperature_B, top_p_B, min_log_prob_B, cache), num_decodes
    )
    rng = jax.random.PRNGKey(0) if decode_rng is None else decode_rng
    if top_k == 1 or (isinstance(temperature, int | float) and temperature == 0.0):
        choose = lambda logits_BV, step: _choose_greedy(logits_BV, rescale_log_probs)
    else:
        top_p = top_p if top_p_B is None else top_p_B
        choose = lambda logits_BV, step: _choose(
            logits_BV, jax.random.fold_in(rng, step), temperature_B, top_k, top_p, rescale_log_probs
        )
    step = functools.partial(
        _sample_step,
        tokens_to_logits=tokens_to_logits,
        choose=choose,
        start=start,
        min_log_prob_B=min_log_prob_B,
        eos_id=eos_id,
        pad_id=pad_id,
        state_callback_fn=state_callback_fn,
        logit_callback_fn=logit_callback_fn,
    )
    carry = SamplingLoopState(
        jnp.zeros((), jnp.int32),
        start.index_B,
        start.token_B1,
        start.sequences_BL,
        cache,
        start.index_B > start.last_B,
        jnp.zeros(start.index_B.shape, jnp.float32),
    )
    carry = jax.lax.while_loop(lambda c: ~jnp.all(c.ended), step, carry)
    if state_callback_fn is not None:
        carry = state_callback_fn(carry)
    sequences_BNL = carry.sequences.reshape(b, num_decodes, length)
    logp_BN = carry.log_prob.reshape(b, num_decodes)
    best_first_BN = jnp.argsort(-logp_BN, axis=1)
    sequences_BNL = jnp.take_along_axis(sequences_BNL, best_first_BN[:, :, None], axis=1)
    return _ordered(sequences_BNL, jnp.take_along_axis(logp_BN, best_first_BN, axis=1), order)


def greedy(
    prompt_BL: Array,
    cache: PyTree,
    tokens_to_logits: TokensToLogits,
    **kwargs: Any,
) -> tuple[Array, Array]:
    """Argmax decoding: `temperature_sample` with temperature 0 (same arguments and returns)."""
    return temperature_sample(prompt_BL, cache, tokens_to_logits, temperature=0.0, **kwargs)


def _take_beams(x_BW: Array, beam_BK: Array) -> Array:
    """[B, W, ...] -> [B, K, ...]: beam `beam_BK[b, k]` of row b."""
    idx = beam_BK.reshape(*beam_BK.shape, *([1] * (x_BW.ndim - 2)))
    return jnp.take_along_axis(x_BW, idx, axis=1)


def _move_cache(cache: PyTree, slot_BW: Array, origin_BW: Array) -> tuple[PyTree, Array]:
    """Gives each new beam the cache row of the beam it continues; returns (cache, slots).

    `slot_BW[b, w]` is the cache row (of the W rows of example b) holding live beam w. A new
    beam takes its parent's row when it is the parent's first child (lowest w); further
    children take the rows of beams left without a child, into which their parent's row is
    copied. Only those rows move (W minus the distinct parents per example, about 2 of 4 in
    the decode benchmark), one row per example at a time, in place: a gather of the whole
    cache by parent wrote every row to a new buffer and copied it back into the loop's carry
    (twice the cache read and written at every step).
    """
    b, w = slot_BW.shape
    src_BW = jnp.take_along_axis(slot_BW, origin_BW, axis=1)  # parent's row
    earlier_BWW = jnp.tril(jnp.ones((w, w), bool), -1)[None]  # [w, w']: w' < w
    dup_BW = jnp.any(earlier_BWW & (src_BW[:, :, None] == src_BW[:, None, :]), axis=2)
    free_BW = ~jnp.any(src_BW[:, :, None] == jnp.arange(w)[None, None], axis=1)  # childless
    free_rows_BW = jnp.argsort(~free_BW, axis=1, stable=True)  # childless rows first, in order
    rank_BW = jnp.clip(jnp.cumsum(dup_BW, axis=1) - 1, 0, w - 1)
    slot_BW = jnp.where(dup_BW, jnp.take_along_axis(free_rows_BW, rank_BW, axis=1), src_BW)
    # Copy j of each example (its j-th extra child; none past its count: an index out of
    # range, dropped). Sources are rows of beams with a child, never a destination, so the
    # order does not matter. Per example (batched over it, like the step's cache writes): a
    # dynamic row index into the flat batch would make a sharded batch all-gather the cache.
    first_BW = jnp.argsort(~dup_BW, axis=1, stable=True)
    src_BJ = jnp.take_along_axis(src_BW, first_BW, axis=1)
    dst_BJ = jnp.where(
        jnp.take_along_axis(dup_BW, first_BW, axis=1),
        jnp.take_along_axis(slot_BW, first_BW, axis=1),
        w,
    )

    def copy(j: Array, c: PyTree) -> PyTree:
        def one(x: Array) -> Array:
            x_bW = x.reshape(b, w, *x.shape[1:])
            rows = jax.vmap(lambda xb, i: xb[i])(x_bW, src_BJ[:, j])
            put = lambda xb, i, row: xb.at[i].set(row, mode="drop")
            return jax.vmap(put)(x_bW, dst_BJ[:, j], rows).reshape(x.shape)

        return jax.tree.map(one, c)

    n_copies = jnp.max(jnp.sum(dup_BW, axis=1))
    return jax.lax.fori_loop(0, n_copies, copy, cache), slot_BW.astype(jnp.int32)


@flax.struct.dataclass
class _Beams:
    """The beam-search loop's carry: W live beams and a pool of W finished ones per row."""

    index_B: Array
    token_BW1: Array
    live_BWL: Array
    live_logp_BW: Array
    fin_BWL: Array
    fin_score_BW: Array  # log_prob / brevity penalty; NEG_INF in slots not yet filled
    fin_flag_BW: Array  # the slot holds a sequence that ended in a generated EOS
    cache: PyTree  # beam w of example b in cache row b * W + slot_BW[b, w]
    slot_BW: Array
    done_B: Array


def _candidates(
    s: _Beams, logp_BWV: Array, start: _Start, pad_id: int
) -> tuple[Array, Array, Array, Array, Array]:
    """The 2W best one-token extensions: log-probs, origin beams, tokens, sequences [B, C, L],
    and whether this step is a forced prompt token [B]."""
    b, w, vocab = logp_BWV.shape
    prompt_B, forced_B = _forced(start.forced_BL, s.index_B, pad_id)
    # A forced position has one free continuation per beam (prompt tokens add no score).
    one_hot_BV = jnp.where(jnp.arange(vocab)[None] == prompt_B[:, None], 0.0, NEG_INF)
    logp_BWV = jnp.where(forced_B[:, None, None], one_hot_BV[:, None], logp_BWV)
    total_BWV = s.live_logp_BW[:, :, None] + logp_BWV
    logp_BC, flat_BC = jax.lax.top_k(total_BWV.reshape(b, w * vocab), 2 * w)
    beam_BC, token_BC = flat_BC // vocab, flat_BC % vocab
    at_11L = jnp.arange(s.live_BWL.shape[-1])[None, None] == s.index_B[:, None, None]
    seqs_BCL = jnp.where(at_11L, token_BC[:, :, None], _take_beams(s.live_BWL, beam_BC))
    return logp_BC, beam_BC, token_BC.astype(jnp.int32), seqs_BCL, forced_B


def _top_w(x_BK: Array, w: int, ascending: bool) -> tuple[Array, Array]:
    """The w largest values of each row and their indices: best first, or (t5x) ascending.

    NOTE: equal values come in index order (`lax.top_k`) before the flip, as in t5x, so with
    `ascending` the beams keep t5x's order and later steps break ties as t5x does."""
    values_BW, idx_BW = jax.lax.top_k(x_BK, w)
    if ascending:
        return values_BW[:, ::-1], idx_BW[:, ::-1]
    return values_BW, idx_BW


def _merge_finished(
    s: _Beams, seqs_BCL: Array, score_BC: Array, finishes_BC: Array, ascending: bool
) -> tuple[Array, Array, Array]:
    """The W best of the finished pool and this step's finished candidates."""
    w = s.fin_score_BW.shape[1]
    pool_score = jnp.concatenate([s.fin_score_BW, jnp.where(finishes_BC, score_BC, NEG_INF)], 1)
    fin_score_BW, idx_BW = _top_w(pool_score, w, ascending)
    pool_flag = jnp.concatenate([s.fin_flag_BW, finishes_BC], axis=1)
    fin_BWL = _take_beams(jnp.concatenate([s.fin_BWL, seqs_BCL], axis=1), idx_BW)
    return fin_BWL, fin_score_BW, jnp.take_along_axis(pool_flag, idx_BW, axis=1)


def _beam_step(
    s: _Beams,
    tokens_to_logits: TokensToLogits,
    start: _Start,
    alpha: float,
    eos_id: int,
    pad_id: int,
    ascending: bool,
    min_log_prob_B: Array | None,
    counts_prompt: bool,
) -> _Beams:
    """Extends every live beam by one token; moves EOS-ended candidates to the finished pool.
    Live beams and the pool are kept best first, or in t5x's ascending order (`ascending`)."""
    b, w, length = s.live_BWL.shape
    # The model sees the beams in cache-row order; everything else is in beam order.
    beam_of_row_BW = jnp.argsort(s.slot_BW, axis=1)
    rows_live_BWL = _take_beams(s.live_BWL, beam_of_row_BW)
    rows_token_BW = jnp.take_along_axis(s.token_BW1.reshape(b, w), beam_of_row_BW, axis=1)
    logits, cache = tokens_to_logits(
        DecodingState(
            jnp.repeat(s.index_B, w),
            rows_token_BW.reshape(b * w, 1),
            rows_live_BWL.reshape(b * w, length),
            s.cache,
        )
    )
    logits_BWV = _take_beams(_logits_BV(logits).reshape(b, w, -1), s.slot_BW)
    logp_BWV = jax.nn.log_softmax(logits_BWV, axis=-1)
    logp_BC, beam_BC, token_BC, seqs_BCL, forced_B = _candidates(s, logp_BWV, start, pad_id)
    eos_BC = (token_BC == eos_id) & ~forced_B[:, None]
    # NOTE: candidates scored near NEG_INF extend beams that never existed (fewer than W
    # continuations so far); they never count as finished.
    finishes_BC = eos_BC & (logp_BC > NEG_INF / 2)
    # The decoded length: positions from where decoding started, or (t5x) every target
    # position so far, a prefilled prompt included.
    from_B = 0 if counts_prompt else start.index_B
    penalty_B1 = brevity_penalty(alpha, s.index_B - from_B + 1)[:, None]
    fin_BWL, fin_score_BW, fin_flag_BW = _merge_finished(
        s, seqs_BCL, logp_BC / penalty_B1, finishes_BC, ascending
    )
    # Live beams: the W best candidates that did not just generate EOS.
    live_logp_BW, live_idx_BW = _top_w(jnp.where(eos_BC, NEG_INF, logp_BC), w, ascending)
    token_BW = jnp.take_along_axis(token_BC, live_idx_BW, axis=1)
    origin_BW = jnp.take_along_axis(beam_BC, live_idx_BW, axis=1)
    # Rows already done keep their beams and pool as they were: that is what they return.
    keep_B1 = s.done_B[:, None]
    keep_B11 = keep_B1[:, :, None]
    origin_BW = jnp.where(keep_B1, jnp.arange(w)[None], origin_BW)
    cache, slot_BW = _move_cache(cache, s.slot_BW, origin_BW)
    new = _Beams(
        index_B=s.index_B + 1,
        token_BW1=jnp.where(keep_B1, s.token_BW1.reshape(b, w), token_BW).reshape(b * w, 1),
        live_BWL=jnp.where(keep_B11, s.live_BWL, _take_beams(seqs_BCL, live_idx_BW)),
        live_logp_BW=jnp.where(keep_B1, s.live_logp_BW, live_logp_BW),
        fin_BWL=jnp.where(keep_B11, s.fin_BWL, fin_BWL),
        fin_score_BW=jnp.where(keep_B1, s.fin_score_BW, fin_score_BW),
        fin_flag_BW=jnp.where(keep_B1, s.fin_flag_BW, fin_flag_BW),
        cache=cache,
        slot_BW=slot_BW,
        done_B=s.done_B,
    )
    # No live beam can beat the worst finished one: its log-probability only falls, and the
    # penalty divides by at most the penalty of the longest possible decode.
    max_len_B = start.last_B - from_B + 1
    best_possible_B = jnp.max(new.live_logp_BW, axis=1) / brevity_penalty(alpha, max_len_B)
    stop_B = (s.index_B >= start.last_B) | (jnp.min(new.fin_score_BW, axis=1) >= best_possible_B)
    if min_log_prob_B is not None:  # t5x: no live beam's log-probability is above it
        stop_B = stop_B | (jnp.max(new.live_logp_BW, axis=1) < min_log_prob_B)
    return new.replace(done_B=s.done_B | stop_B)


def beam_search(
    prompt_BL: Array,
    cache: PyTree,
    tokens_to_logits: TokensToLogits,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    initial_index: Array | None = None,
    max_decode_steps: int | Array | None = None,
    max_decode_steps_after_prompt: bool = False,
    min_log_prob: float | Array | None = None,
    brevity_counts_prompt: bool = False,
    eos_id: int = EOS_ID,
    pad_id: int = PAD_ID,
    decoder_start_token_id: int = DECODER_START_ID,
    order: str = "best_first",
) -> tuple[Array, Array]:
    """Beam search with the t5x brevity penalty `((5 + len) / 6) ** alpha`; t5x's results.

    Each step extends the W live beams by every token, keeps the 2W best candidates, moves
    those ending in a generated EOS to the finished pool scored by
    `log_prob / brevity_penalty(alpha, decoded_length)`, and keeps the W best others live.
    A row stops at its last position or when no live beam can still beat the worst finished
    one. As t5x, a row returns its finished (EOS-ended) beams; only a row where no beam
    finished returns its live beams (cut by the length limit), scored by their plain
    log-probability. Finished-pool slots never filled score NEG_INF and hold just the prompt.

    The cache is never reordered as a whole: each live beam keeps a cache row of its example,
    and `tokens_to_logits` sees the rows in that order (`DecodingState` fields are per row);
    a beam's row holds its own history (see `_move_cache`).

    Args:
      prompt_BL, cache, tokens_to_logits, initial_index, max_decode_steps,
        max_decode_steps_after_prompt, eos_id, pad_id, decoder_start_token_id: as for
        `temperature_sample` (prompt tokens are forced).
      beam_size: W, beams per row (the cache is repeated W times); static.
      alpha: brevity penalty exponent (0: plain log-probability).
      min_log_prob: a row stops once none of its live beams has a log-probability (without
        the brevity penalty) at or above this (t5x's `min_log_prob`, per row). None: no limit.
        A scalar or [B]; may be traced.
      brevity_counts_prompt: t5x's penalty length: every target position up to the new
        token, a prefilled prompt (positions < initial_index) included. Default: the positions
        from `initial_index` (the two agree without `initial_index`); static.
      order: "best_first", or "best_last": t5x's order, in which beams are also kept during the
        search, so that equal scores are broken as t5x breaks them.

    Returns:
      (sequences [B, W, L] int32, scores [B, W] fp32), in `order`.
    """
    _check_order(order)
    b, w = prompt_BL.shape[0], beam_size
    start = _start(
        prompt_BL,
        initial_index,
        max_decode_steps,
        pad_id,
        decoder_start_token_id,
        max_decode_steps_after_prompt,
    )
    min_log_prob_B = None if min_log_prob is None else _per_row(min_log_prob, b, "min_log_prob")
    # Only beam 0 is live at first, so the W copies do not yield W equal candidates.
    live_logp_BW = jnp.full((b, w), NEG_INF, jnp.float32).at[:, 0].set(0.0)
    first_BWL = jnp.repeat(start.sequences_BL[:, None], w, axis=1)
    carry = _Beams(
        start.index_B,
        jnp.repeat(start.token_B1, w, axis=0),
        first_BWL,
        live_logp_BW,
        first_BWL,
        jnp.full((b, w), NEG_INF, jnp.float32),
        jnp.zeros((b, w), bool),
        expand_batch(cache, w),
        jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w)),
        start.index_B > start.last_B,
    )
    step = functools.partial(
        _beam_step,
        tokens_to_logits=tokens_to_logits,
        start=start,
        alpha=alpha,
        eos_id=eos_id,
        pad_id=pad_id,
        ascending=order == "best_last",
        min_log_prob_B=min_log_prob_B,
        counts_prompt=brevity_counts_prompt,
    )
    s = jax.lax.while_loop(lambda s: ~jnp.all(s.done_B), step, carry)
    finished_B = jnp.any(s.fin_flag_BW, axis=1)
    sequences_BWL = jnp.where(finished_B[:, None, None], s.fin_BWL, s.live_BWL)
    scores_BW = jnp.where(finished_B[:, None], s.fin_score_BW, s.live_logp_BW)
    # The beams are in `order` already (best_last: t5x's, ties included).
    return sequences_BWL.astype(jnp.int32), scores_BW
