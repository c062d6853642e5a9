"""KV-cached decoding: equals full recomputation, greedy / sampling / beam search agree where they
must, the same tokens on every mesh, and the cache sharded as its logical axes say."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite import partitioning
from t5lite.model import decoding, kv_cache, models, network

T5_TINY = network.T5Config(
    vocab_size=128, emb_dim=16, num_heads=8, head_dim=4, mlp_dim=32,
    num_encoder_layers=2, num_decoder_layers=2, relpos_num_buckets=8, relpos_max_distance=16,
)  # fmt: skip
LM_TINY = network.DecoderOnlyConfig(
    vocab_size=128, emb_dim=16, num_heads=8, num_kv_heads=4, head_dim=4, mlp_dim=32, num_layers=2
)  # fmt: skip
B, S, L = 8, 6, 8  # batch, encoder length, decoder length
NO_EOS = -1  # an id no token equals: decodes run to the end


def _model(arch: str, scan: bool = False, **kwargs) -> models.BaseModel:
    if arch == "t5":
        cfg = dataclasses.replace(T5_TINY, scan_layers=scan)
        return models.EncoderDecoderModel(network_config=cfg, **kwargs)
    pos = "relative" if arch == "lm_relative" else "rope"
    cfg = dataclasses.replace(LM_TINY, scan_layers=scan, position_embedding=pos)
    return models.DecoderOnlyModel(network_config=cfg, **kwargs)


def _batch(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    if arch == "t5":
        enc = rng.randint(2, 128, (B, S)).astype(np.int32)
        enc[2, 4:] = 0  # padding
        return {"encoder_input_tokens": enc, "decoder_input_tokens": np.zeros((B, L), np.int32)}
    # Prefix-LM rows: [BOS, inputs..., targets...] with 0..4 inputs per row.
    n_inputs = np.array([0, 1, 2, 3, 4, 2, 1, 3])
    dec_in = np.zeros((B, L), np.int32)
    causal = np.zeros((B, L), np.int32)
    for r, n in enumerate(n_inputs):
        dec_in[r, 1 : n + 1] = rng.randint(2, 128, n)
        causal[r, : n + 1] = 1
    return {"decoder_input_tokens": dec_in, "decoder_causal_attention": causal}


@functools.cache
def _params(arch: str, scan: bool = False):
    model = _model(arch, scan)
    batch = {k: jnp.asarray(v) for k, v in _batch(arch).items()}
    boxed = jax.jit(model.init)(jax.random.PRNGKey(7), batch)
    return meta.unbox(boxed)["params"], partitioning.logical_axes_of(boxed)["params"]


def _recompute_greedy(model: models.BaseModel, params, batch, steps: int) -> np.ndarray:
    """Reference: the whole teacher-forced forward pass again at every step (no cache)."""
    batch = {k: np.asarray(v) for k, v in batch.items()}
    fwd = jax.jit(lambda p, b: model._logits(p, b, None))
    if isinstance(model, models.EncoderDecoderModel):
        start = np.zeros(B, np.int64)
        dec_in = np.zeros((B, L), np.int32)
    else:
        causal = batch["decoder_causal_attention"]
        start = causal.sum(1) - 1
        dec_in = batch["decoder_input_tokens"] * causal
    out = np.zeros((B, steps), np.int32)
    done = np.zeros(B, bool)
    for t in range(steps):
        logits = np.asarray(fwd(params, {**batch, "decoder_input_tokens": dec_in}))
        for r in range(B):
            i = start[r] + t
            if done[r] or i >= L:
                continue
            tok = int(np.argmax(logits[r, i]))
            out[r, t] = tok
            if i + 1 < L:
                dec_in[r, i + 1] = tok
            done[r] = tok == decoding.EOS_ID
    return out


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("arch", ["t5", "lm", "lm_relative"])
def test_cached_greedy_equals_recomputation(arch, scan):
    model = _model(arch, scan)
    params, _ = _params(arch, scan)
    batch = _batch(arch)
    got = np.asarray(jax.jit(model.predict_batch)(params, batch))
    assert got.shape == (B, L)
    want = _recompute_greedy(model, params, batch, L)
    np.testing.assert_array_equal(got, want)
    assert len(set(map(tuple, got.tolist()))) > 1  # non-trivial decodes


def test_cached_logits_equal_full_forward_at_every_step():
    """Teacher-forced step by step through the cache == one full forward (T5, relpos bias)."""
    model = _model("t5")
    module = model.module()
    params, _ = _params("t5")
    rng = np.random.RandomState(1)
    enc = jnp.asarray(rng.randint(2, 128, (B, S)), jnp.int32)
    dec = jnp.asarray(rng.randint(2, 128, (B, L)), jnp.int32).at[:, 0].set(0)
    # Every apply under jit: eagerly, each op of a forward pass compiles as its own program.
    full = jax.jit(functools.partial(module.apply, enable_dropout=False))(
        {"params": params}, enc, dec
    )
    encoded = jax.jit(functools.partial(module.apply, enable_dropout=False, method=module.encode))(
        {"params": params}, enc
    )
    call = jax.jit(functools.partial(
        module.apply, enable_dropout=False, decode=True, max_decode_length=L,
        method=module.decode, mutable=["cache"],
    ))  # fmt: skip
    cache = kv_cache.zero_cache(lambda: call({"params": params}, encoded, enc, dec))
    steps = []
    for i in range(L):
        logits, v = call({"params": params, "cache": cache}, encoded, enc, dec[:, i : i + 1])
        cache = v["cache"]
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5, rtol=0)
    assert cache["decoder"]["cache_index"].tolist() == [L] * B


@pytest.mark.parametrize("arch", ["t5", "lm"])
def test_beam_of_one_equals_greedy(arch):
    params, _ = _params(arch)
    batch = _batch(arch)
    greedy = np.asarray(jax.jit(_model(arch).predict_batch)(params, batch))
    beam = _model(arch, decoding_method="beam", beam_size=1, alpha=0.6)
    got = np.asarray(jax.jit(beam.predict_batch)(params, batch))
    np.testing.assert_array_equal(got, greedy)
    # Wider beams: all of them, best first.
    wide = _model(arch, decoding_method="beam", beam_size=4, alpha=0.0)
    _, aux = jax.jit(functools.partial(wide.predict_batch_with_aux, return_all_decodes=True))(
        params, batch
    )
    assert aux["scores"].shape == (B, 4)
    assert np.all(np.diff(np.asarray(aux["scores"]), axis=1) <= 0)  # best first


def test_beams_attend_one_copy_of_the_encoding_and_equal_recomputation():
    """Beam search through the KV cache equals beam search over the whole teacher-forced
    decoder recomputed at every step (no cache; encodings repeated per beam), and the beams of
    an example read one copy of its cross-attention keys/values: the loop body holds them for
    B rows, never repeated for B * W."""
    w = 3
    params, _ = _params("t5")
    batch = _batch("t5")
    model = _model("t5", decoding_method="beam", beam_size=w, alpha=0.6)
    predict = jax.jit(functools.partial(model.predict_batch_with_aux, return_all_decodes=True))
    compiled = predict.lower(params, batch).compile()
    seqs, aux = compiled(params, batch)

    enc_n = np.repeat(batch["encoder_input_tokens"], w, axis=0)

    def recompute(state: decoding.DecodingState):
        dec_in = jnp.pad(state.sequences[:, :-1], ((0, 0), (1, 0)))  # start token 0 first
        logits = model._logits(
            params, {"encoder_input_tokens": enc_n, "decoder_input_tokens": dec_in}, None
        )
        return jnp.take_along_axis(logits, state.cur_index[:, None, None], axis=1), state.cache

    ref = jax.jit(
        lambda: decoding.beam_search(
            jnp.zeros((B, L), jnp.int32), jnp.zeros((B,)), recompute, beam_size=w, alpha=0.6,
            eos_id=model.eos_id, pad_id=model.pad_id,
        )
    )  # fmt: skip
    want_seqs, want_scores = ref()
    np.testing.assert_array_equal(np.asarray(seqs), np.asarray(want_seqs))
    np.testing.assert_allclose(aux["scores"], want_scores, atol=1e-5, rtol=0)

    h, k = T5_TINY.num_heads, T5_TINY.head_dim
    shapes = {shape for shape, _, _ in _while_body_ops(compiled.as_text())}
    cross = lambda rows: {f"f32[{rows},{h},{S},{k}]", f"f32[{rows},{h},{k},{S}]"}
    assert cross(B) <= shapes and not cross(B * w) & shapes


def test_model_eos_and_decoder_start_ids():
    """predict_batch stops at the model's own EOS and feeds its own decoder start token."""
    params, _ = _params("t5")
    batch = _batch("t5")
    free = np.asarray(jax.jit(_model("t5", eos_id=NO_EOS).predict_batch)(params, batch))
    eos = int(free[0, 2])  # a token greedy emits: as this model's EOS, rows stop at it
    got = np.asarray(jax.jit(_model("t5", eos_id=eos).predict_batch)(params, batch))
    want = free.copy()
    for r in range(B):
        hits = np.flatnonzero(free[r] == eos)
        if hits.size:
            want[r, hits[0] + 1 :] = 0
    np.testing.assert_array_equal(got, want)
    assert (want != free).any()
    # The first token is the prediction after the model's decoder start token.
    start = 5
    first = jax.jit(_model("t5", decoder_start_token_id=start).predict_batch)(params, batch)
    dec_in = np.zeros((B, L), np.int32)
    dec_in[:, 0] = start
    logits = jax.jit(lambda p, b: _model("t5")._logits(p, b, None))(
        params, {**batch, "decoder_input_tokens": dec_in}
    )
    np.testing.assert_array_equal(np.asarray(first)[:, 0], np.argmax(logits[:, 0], -1))


def test_model_decode_order_and_traced_decoder_params():
    params, _ = _params("t5")
    batch = _batch("t5")
    beams = {}
    for order in ("best_first", "best_last"):
        model = _model("t5", decoding_method="beam", beam_size=3, decode_order=order)
        fn = functools.partial(model.predict_batch_with_aux, return_all_decodes=True)
        beams[order] = jax.tree.map(np.asarray, jax.jit(fn)(params, batch))
        best = jax.jit(model.predict_batch)(params, batch)
        np.testing.assert_array_equal(best, beams["best_first"][0][:, 0])  # the best, either way
    (seqs, aux), (seqs_t5x, aux_t5x) = beams["best_first"], beams["best_last"]
    assert np.all(np.diff(aux_t5x["scores"], axis=1) >= 0)  # t5x: ascending, best last
    np.testing.assert_array_equal(seqs_t5x, seqs[:, ::-1])
    np.testing.assert_array_equal(aux_t5x["scores"], aux["scores"][:, ::-1])
    # Per-row temperature as a traced argument: rows at 0 decode greedily.
    greedy = np.asarray(jax.jit(_model("t5").predict_batch)(params, batch))
    model = _model("t5", decoding_method="sample")
    fn = jax.jit(
        lambda p, b, t: model.predict_batch_with_aux(p, b, decoder_params={"temperature": t})
    )
    got = np.asarray(fn(params, batch, jnp.array([0.0] * (B // 2) + [1.0] * (B // 2)))[0])
    np.testing.assert_array_equal(got[: B // 2], greedy[: B // 2])
    assert not np.array_equal(got[B // 2 :], greedy[B // 2 :])
    # Traced, not run: the refusal comes after the encoder, whose ops eagerly compile one by one.
    refused = functools.partial(model.predict_batch_with_aux, decoder_params={"beam_size": 2})
    with pytest.raises(ValueError, match=r"decoder_params \['beam_size'\] do not apply"):
        jax.jit(refused)(params, batch)


def test_sampling_top_k_one_and_tiny_top_p_are_greedy_and_seeds_reproduce():
    arch = "t5"
    params, _ = _params(arch)
    batch = _batch(arch)
    greedy = np.asarray(jax.jit(_model(arch).predict_batch)(params, batch))

    def sample(rng, **kw):
        model = _model(arch, decoding_method="sample", **kw)
        return np.asarray(jax.jit(model.predict_batch)(params, batch, rng))

    k0, k1 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    np.testing.assert_array_equal(sample(k0, top_k=1, temperature=2.0), greedy)
    np.testing.assert_array_equal(sample(k1, top_p=1e-6, temperature=2.0), greedy)
    # Several decodes per example, most likely first; a seed reproduces them.
    model = _model(arch, decoding_method="sample", num_decodes=3, temperature=1.5)
    fn = jax.jit(functools.partial(model.predict_batch_with_aux, return_all_decodes=True))
    (a, aux), (b, _), (c, _) = fn(params, batch, k0), fn(params, batch, k0), fn(params, batch, k1)
    assert a.shape == (B, 3, L) and aux["scores"].shape == (B, 3)
    assert np.all(np.diff(np.asarray(aux["scores"]), axis=1) <= 0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a[:, 0], greedy)
    assert not np.array_equal(a[:, 0], a[:, 1])


def test_filter_logits():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda x: (np.asarray(x) > decoding.NEG_INF / 2).astype(int).tolist()
    assert kept(decoding.filter_logits(logits, top_k=2)) == [[1, 1, 0, 0]]
    assert kept(decoding.filter_logits(logits, top_p=0.5)) == [[1, 0, 0, 0]]
    assert kept(decoding.filter_logits(logits, top_p=0.6)) == [[1, 1, 0, 0]]
    assert kept(decoding.filter_logits(logits, top_p=0.9)) == [[1, 1, 1, 0]]
    assert kept(decoding.filter_logits(logits, top_k=3, top_p=0.99)) == [[1, 1, 1, 0]]


# --- the decoding algorithms on a toy Markov model (no network) ------------------------------


def _markov(table_VV: np.ndarray):
    """tokens_to_logits of a bigram model; the 'cache' counts calls per row."""
    table = jnp.asarray(table_VV, jnp.float32)

    def tokens_to_logits(state: decoding.DecodingState):
        return table[state.cur_token[:, 0]], state.cache + 1

    return tokens_to_logits


def _log_softmax(table: np.ndarray) -> np.ndarray:
    """jax's fp32 log-softmax of a table, read on the host: indexing a device array with Python
    ints compiles a program per distinct index (hundreds over these tests on a cold cache)."""
    return np.asarray(jax.nn.log_softmax(jnp.asarray(table, jnp.float32), -1))


def _score(table, seq, alpha, eos):
    """log p(seq) / brevity penalty for one complete sequence of generated tokens."""
    logp = _log_softmax(table)
    prev, total = 0, 0.0
    for t in seq:
        total += float(logp[prev, t])
        prev = t
    return total / float(decoding.brevity_penalty(alpha, jnp.asarray(len(seq))))


@pytest.mark.parametrize("alpha", [0.0, 0.8])
def test_exhaustive_beam_search_returns_every_finished_sequence(alpha):
    """With a beam per possible sequence: exactly the EOS-ended ones, best first (t5x)."""
    v, length, eos = 4, 3, 1
    table = np.random.RandomState(3).normal(size=(v, v)) * 2.0
    finished = [
        seq
        for n in range(1, length + 1)
        for seq in itertools.product(range(v), repeat=n)
        if eos not in seq[:-1] and seq[-1] == eos
    ]
    want = sorted(finished, key=lambda s: -_score(table, s, alpha, eos))
    prompt = jnp.zeros((1, length), jnp.int32)
    seqs, scores = decoding.beam_search(
        prompt, jnp.zeros((1,)), _markov(table), beam_size=v**length, alpha=alpha, eos_id=eos
    )
    got = [tuple(s[: s.index(eos) + 1]) for s in np.asarray(seqs[0, : len(want)]).tolist()]
    assert got == want
    np.testing.assert_allclose(
        scores[0, : len(want)], [_score(table, s, alpha, eos) for s in want], rtol=1e-5
    )
    # The slots no finished sequence filled: NEG_INF and no tokens.
    assert np.all(np.asarray(scores[0, len(want) :]) == decoding.NEG_INF)
    assert not np.asarray(seqs[0, len(want) :]).any()


def _markov_rows(tables_RVV: np.ndarray):
    """tokens_to_logits of one bigram model per row; the 'cache' is each row's table index."""
    tables = jnp.asarray(tables_RVV, jnp.float32)

    def tokens_to_logits(state: decoding.DecodingState):
        return tables[state.cache, state.cur_token[:, 0]], state.cache

    return tokens_to_logits


def _beam_tables() -> np.ndarray:
    """Row 0: EOS first is fine, later unlikely; row 1: EOS never makes the top 2W."""
    v, eos = 6, 1
    tables = np.zeros((2, v, v))
    tables[:, :, 2], tables[:, :, 3], tables[:, :, 0] = 5.0, 3.0, -10.0
    tables[:, :, eos] = -10.0
    tables[0, 0, eos] = 4.0  # after BOS
    tables[1] += np.random.RandomState(0).uniform(0, 0.5, (v, v))  # no ties among live beams
    return tables


def test_beam_search_prefers_finished_beams_and_falls_back_to_live_ones():
    """t5x: a row returns its EOS-ended beams even when a live (length-limited) beam scores
    higher; a row where no beam finished returns its live beams, scored by log-probability."""
    tables, length, eos = _beam_tables(), 3, 1
    logp = _log_softmax(tables)
    prompt = jnp.zeros((2, length), jnp.int32)
    seqs, scores = decoding.beam_search(
        prompt, jnp.arange(2), _markov_rows(tables), beam_size=2, alpha=0.0, eos_id=eos
    )
    seqs, scores = np.asarray(seqs), np.asarray(scores)
    # Row 0: [EOS] finished; the live [2, 2, 2] is more likely, but it never ended.
    live_logp = 3 * float(logp[0, 2, 2])
    assert live_logp > float(logp[0, 0, eos])
    assert seqs[0].tolist() == [[eos, 0, 0], [0, 0, 0]]
    np.testing.assert_allclose(scores[0], [float(logp[0, 0, eos]), decoding.NEG_INF], rtol=1e-6)
    # Row 1: nothing finished, so the live beams: the two best length-3 sequences.
    best = sorted(itertools.product(range(6), repeat=length), key=lambda s: -_logp(tables[1], s))
    assert [tuple(s) for s in seqs[1].tolist()] == best[:2]
    np.testing.assert_allclose(scores[1], [_logp(tables[1], s) for s in best[:2]], rtol=1e-5)
    # t5x's order is the exact reverse.
    seqs_t5x, scores_t5x = decoding.beam_search(
        prompt, jnp.arange(2), _markov_rows(tables), beam_size=2, alpha=0.0, eos_id=eos,
        order="best_last",
    )  # fmt: skip
    np.testing.assert_array_equal(seqs_t5x, seqs[:, ::-1])
    np.testing.assert_array_equal(scores_t5x, scores[:, ::-1])


def test_eos_stops_decoding_and_pads():
    v = 5
    table = np.full((v, v), -5.0)
    table[0, 3] = table[3, 4] = table[4, decoding.EOS_ID] = 5.0  # BOS -> 3 -> 4 -> EOS
    table[1, 2] = 5.0  # after EOS it would say 2: must not be emitted
    prompt = jnp.zeros((2, 7), jnp.int32)
    want = [3, 4, 1, 0, 0, 0, 0]
    seqs, _ = decoding.greedy(prompt, jnp.zeros((2,)), _markov(table))
    assert np.asarray(seqs[:, 0]).tolist() == [want, want]
    seqs, _ = decoding.beam_search(prompt, jnp.zeros((2,)), _markov(table), beam_size=2)
    assert np.asarray(seqs[:, 0]).tolist() == [want, want]
    # max_decode_steps caps the new tokens of a row.
    seqs, _ = decoding.greedy(prompt, jnp.zeros((2,)), _markov(table), max_decode_steps=2)
    assert np.asarray(seqs[:, 0]).tolist() == [[3, 4, 0, 0, 0, 0, 0]] * 2


def test_prompt_prefill_and_initial_index():
    """Rows start at their own index; the prompt is kept in target coordinates."""
    v = 6
    table = np.full((v, v), -5.0)
    for a, b in [(2, 3), (3, 4), (4, 5), (5, 2), (0, 2)]:
        table[a, b] = 5.0
    prompt = jnp.array([[0, 5, 0, 0, 0], [0, 3, 4, 0, 0]], jnp.int32)
    seqs, _ = decoding.greedy(
        prompt, jnp.zeros((2,)), _markov(table), initial_index=jnp.array([1, 2])
    )
    assert np.asarray(seqs[:, 0]).tolist() == [[5, 2, 3, 4, 5], [3, 4, 5, 2, 3]]


def _chain(v: int, pairs, eos_logit: float = -5.0) -> np.ndarray:
    """A bigram table that almost surely goes a -> b for each (a, b) in pairs."""
    table = np.full((v, v), -5.0)
    table[:, 1] = eos_logit  # -50: EOS never makes a beam candidate (no EOS-ended beams)
    for a, b in pairs:
        table[a, b] = 5.0
    return table


def _logp(table, seq, prev=0) -> float:
    """Log-probability of the tokens of seq under the bigram table, after token prev."""
    logp = _log_softmax(table)
    return sum(float(logp[a, b]) for a, b in zip((prev, *seq[:-1]), seq))


def test_prompt_without_initial_index_is_forced():
    """t5x: every non-pad prompt token is forced, gaps are generated; forced tokens add nothing
    to the score and a forced EOS does not end the row."""
    table = _chain(6, [(0, 2), (2, 3), (3, 4), (4, 5), (5, 2), (1, 2)], eos_logit=-50.0)
    prompt = jnp.array([[0, 4, 0, 1, 0, 0, 0]], jnp.int32)  # 4, (gap), EOS, then free
    want = [4, 5, 1, 2, 3, 4, 5]
    seqs, logp = decoding.greedy(prompt, jnp.zeros((1,)), _markov(table))
    assert np.asarray(seqs[0, 0]).tolist() == want
    generated = _logp(table, [5], prev=4) + _logp(table, [2, 3, 4, 5], prev=1)
    np.testing.assert_allclose(float(logp[0, 0]), generated, rtol=1e-6)
    seqs, _ = decoding.beam_search(prompt, jnp.zeros((1,)), _markov(table), beam_size=2)
    assert np.asarray(seqs[0, 0]).tolist() == want
    seqs, _ = decoding.temperature_sample(
        prompt, jnp.zeros((1,)), _markov(table), num_decodes=4, temperature=3.0
    )
    samples = np.asarray(seqs[0])
    assert (samples[:, 0] == 4).all() and (samples[:, 2] == 1).all()  # forced in each sample


def test_prompt_after_initial_index_is_forced():
    table = _chain(6, [(2, 3), (3, 4), (4, 5), (5, 2), (0, 2)], eos_logit=-50.0)
    # Row 0 resumes after its prefilled prompt [5] and must still place the 4 at position 3.
    prompt = jnp.array([[0, 5, 0, 4, 0, 0], [0, 3, 0, 0, 0, 0]], jnp.int32)
    initial = jnp.array([1, 1])
    for decode in (decoding.greedy, functools.partial(decoding.beam_search, beam_size=2)):
        seqs, _ = decode(prompt, jnp.zeros((2,)), _markov(table), initial_index=initial)
        assert np.asarray(seqs[:, 0]).tolist() == [[5, 2, 4, 5, 2, 3], [3, 4, 5, 2, 3, 4]]


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([[0, 2, 0, 0, 0], [0, 2, 3, 4, 0]], {"max_decode_steps": 3},
         r"the prompt of row 1 leaves no room to decode: it runs to prompt_BL\[1, 3\], but the "
         r"row decodes positions 1..3 only \(decode length 5, max_decode_steps 3\)"),
        ([[0, 2, 3, 0, 0]], {"initial_index": np.array([1]), "max_decode_steps": 1},
         r"the prompt of row 0 leaves no room to decode"),
        ([[0, 2, 0, 0, 0], [7, 2, 0, 0, 0]], {},
         r"prompt_BL\[1, 0\] = 7, but position 0 is the decoder start slot"),
        ([[0, 2, 0, 0, 0]], {"initial_index": np.array([5])},
         r"initial_index\[0\] = 5 leaves no position to decode: it must be in \[0, 4\]"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_a_prompt_that_cannot_be_honoured_is_refused(prompt, kwargs, message, method):
    decode = decoding.greedy if method == "greedy" else decoding.beam_search
    prompt = np.array(prompt, np.int32)
    table = _chain(8, [(0, 2)])
    with pytest.raises(ValueError, match=message):
        decode(prompt, jnp.zeros((len(prompt),)), _markov(table), **kwargs)


def test_eos_pad_and_start_ids_are_parameters():
    """A model whose EOS is 2 stops at 2, not at 1; pad and decoder start ids are its own."""
    table = _chain(8, [(0, 3), (3, 1), (1, 4), (4, 2), (2, 5), (6, 4), (5, 5)])
    prompt = jnp.zeros((1, 6), jnp.int32)
    args = (prompt, jnp.zeros((1,)), _markov(table))
    for decode in (decoding.greedy, functools.partial(decoding.beam_search, beam_size=2)):
        assert np.asarray(decode(*args)[0][0, 0]).tolist() == [3, 1, 0, 0, 0, 0]
        seqs, _ = decode(*args, eos_id=2)
        assert np.asarray(seqs[0, 0]).tolist() == [3, 1, 4, 2, 0, 0]
        no_prompt = jnp.full((1, 6), 7, jnp.int32)  # pad_id 7: a 0 would be a prompt token
        seqs, _ = decode(no_prompt, *args[1:], eos_id=2, pad_id=7, decoder_start_token_id=6)
        assert np.asarray(seqs[0, 0]).tolist() == [4, 2, 7, 7, 7, 7]


def test_order_best_last_is_t5x_ascending():
    table = np.random.RandomState(4).normal(size=(8, 8)) * 2.0
    args = (jnp.zeros((2, 5), jnp.int32), jnp.zeros((2,)), _markov(table))
    for kw in ({"num_decodes": 4, "temperature": 2.0}, {"beam_size": 4}):
        decode = decoding.beam_search if "beam_size" in kw else decoding.temperature_sample
        seqs, scores = decode(*args, **kw)
        seqs_t5x, scores_t5x = decode(*args, order="best_last", **kw)
        assert np.all(np.diff(np.asarray(scores_t5x), axis=1) >= 0)  # best last
        np.testing.assert_array_equal(seqs_t5x, seqs[:, ::-1])
        np.testing.assert_array_equal(scores_t5x, scores[:, ::-1])
    with pytest.raises(ValueError, match="order must be one of"):
        decoding.greedy(*args, order="t5")


def test_sampling_options_are_traced_and_per_row():
    """temperature / top_p / min_log_prob ([B] or scalar) and max_decode_steps as jit args."""
    b, v, length, no_eos = 4, 16, 10, -1
    table = np.random.RandomState(5).normal(size=(v, v))
    prompt = jnp.zeros((b, length), jnp.int32)
    args = (prompt, jnp.zeros((b,)), _markov(table))
    greedy = np.asarray(decoding.greedy(*args, eos_id=no_eos)[0][:, 0])

    @jax.jit
    def sample(temperature, top_p, steps, min_log_prob):
        return decoding.temperature_sample(
            *args, decode_rng=jax.random.PRNGKey(3), temperature=temperature, top_p=top_p,
            max_decode_steps=steps, min_log_prob=min_log_prob, eos_id=no_eos,
        )  # fmt: skip

    rows = lambda *x: jnp.array(x, jnp.float32)  # one value per row
    unlimited, no_floor = rows(1.0, 1.0, 1.0, 1.0), rows(-1e9, -1e9, -1e9, -1e9)
    hot = rows(0.0, 0.0, 1.0, 1.0)
    seqs = np.asarray(sample(hot, unlimited, length, no_floor)[0][:, 0])
    np.testing.assert_array_equal(seqs[:2], greedy[:2])  # temperature 0: argmax
    assert not np.array_equal(seqs[2], greedy[2]) and not np.array_equal(seqs[3], greedy[3])
    tiny_p = rows(1.0, 1.0, 1e-6, 1e-6)
    np.testing.assert_array_equal(sample(hot, tiny_p, length, no_floor)[0][:, 0], greedy)
    seqs = np.asarray(sample(rows(0, 0, 0, 0), unlimited, 3, no_floor)[0][:, 0])
    np.testing.assert_array_equal(seqs[:, :3], greedy[:, :3])
    assert not seqs[:, 3:].any()
    # min_log_prob: a row stops once its log-probability falls below it (that token kept).
    row = greedy[0].tolist()
    cum = np.cumsum([_logp(table, [t], prev=p) for p, t in zip([0, *row[:-1]], row)])
    floor = rows((cum[2] + cum[3]) / 2, -1e9, -1e9, -1e9)
    seqs, logp = sample(rows(0, 0, 0, 0), unlimited, length, floor)
    assert np.asarray(seqs[0, 0]).tolist() == [*greedy[0, :4].tolist(), 0, 0, 0, 0, 0, 0]
    np.testing.assert_allclose(float(logp[0, 0]), cum[3], rtol=1e-5)
    np.testing.assert_array_equal(seqs[1:, 0], greedy[1:])
    assert sample._cache_size() == 1  # new values, no retracing
    # Scalars (traced too) work as well.
    np.testing.assert_array_equal(sample(0.0, 0.5, length, -1e9)[0][:, 0], greedy)
    # Beam search: max_decode_steps and alpha traced.
    beam = lambda steps, alpha: decoding.beam_search(
        *args, beam_size=2, alpha=alpha, max_decode_steps=steps, eos_id=no_eos
    )
    for got, want in zip(jax.jit(beam)(3, 0.6), beam(3, 0.6)):
        np.testing.assert_array_equal(got, want)


# --- the same tokens on every mesh; the cache sharded as its logical axes say ----------------

MESHES = [(1, 8), (2, 4), (4, 2)]
PRESETS = ("megatron", "fsdp")  # names in partitioning.PRESETS
# Every mesh, preset and architecture appears in the fast set; the rest of the product is slow.
_FAST = {("t5", (2, 4), "megatron"), ("lm", (4, 2), "fsdp"), ("lm", (1, 8), "megatron")}
_MESH_CASES = [
    pytest.param(a, m, p, marks=() if (a, m, p) in _FAST else pytest.mark.slow,
                 id=f"{a}-{m[0]}x{m[1]}-{p}")
    for a in ("t5", "lm") for m in MESHES for p in PRESETS
]  # fmt: skip


def _partitioner(mesh_shape, preset):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "model"))
    rules = partitioning.preset_rules(preset)
    return partitioning.Partitioner(mesh=mesh, logical_axis_rules=rules)


@functools.cache
def _single_device_decodes(arch: str, method: str) -> np.ndarray:
    model = _model(arch, arch == "lm", decoding_method=method, beam_size=2)
    return np.asarray(jax.jit(model.predict_batch)(_params(arch, arch == "lm")[0], _batch(arch)))


@pytest.mark.parametrize(("arch", "mesh_shape", "preset"), _MESH_CASES)
def test_decodes_identical_across_meshes(arch, mesh_shape, preset):
    require_devices(8)
    scan = arch == "lm"
    params, axes = _params(arch, scan)
    batch = _batch(arch)
    for method in ("greedy", "beam"):
        model = _model(arch, scan, decoding_method=method, beam_size=2)
        want = _single_device_decodes(arch, method)
        part = _partitioner(mesh_shape, preset)
        param_sh = part.shardings(params, axes)
        data_sh = NamedSharding(part.mesh, P("data"))
        batch_sh = {k: data_sh for k in batch}
        predict = part.partition(
            model.predict_batch, in_shardings=(param_sh, batch_sh), out_shardings=None
        )
        got = predict(jax.device_put(params, param_sh), jax.device_put(batch, batch_sh))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=method)


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_cache_sharded_by_its_logical_axes(scan):
    require_devices(8)
    arch = "lm"
    model = _model(arch, scan)
    module = model.module()
    params, axes = _params(arch, scan)
    part = _partitioner((2, 4), "megatron")
    param_sh = part.shardings(params, axes)

    def create(p, tokens):
        return module.apply(
            {"params": p}, tokens, enable_dropout=False, decode=True, max_decode_length=L,
            mutable=["cache"],
        )  # fmt: skip

    tokens = jnp.zeros((B, L), jnp.int32)
    _, boxed = jax.eval_shape(create, params, tokens)
    cache_axes = partitioning.logical_axes_of(boxed["cache"])
    want_sh = part.shardings(meta.unbox(boxed["cache"]), cache_axes)

    def step(p, tokens):
        cache = kv_cache.zero_cache(lambda: create(p, tokens))
        _, v = module.apply(
            {"params": p, "cache": cache}, tokens[:, :1], enable_dropout=False, decode=True,
            max_decode_length=L, mutable=["cache"],
        )  # fmt: skip
        return v["cache"]

    # Output shardings left to propagation: what comes out is what the model code constrained.
    with part.context():
        cache = jax.jit(step)(jax.device_put(params, param_sh), tokens)
    layer = cache["decoder"]["layers" if scan else "layers_0"]["self_attention"]
    kv = layer["cached_key"]
    lead = (None,) if scan else ()
    # [batch, (layers,) kv_heads=4, length, kv]: batch over data, kv heads over model.
    assert kv.shape == ((B, 2, 4, L, 4) if scan else (B, 4, L, 4))
    assert kv.sharding.is_equivalent_to(
        NamedSharding(part.mesh, P("data", *lead, "model", None, None)), kv.ndim
    )
    # Values keep the contraction (length) last: [batch, (layers,) kv_heads, kv, length].
    kv = layer["cached_value"]
    assert kv.shape == ((B, 2, 4, 4, L) if scan else (B, 4, 4, L))
    assert kv.sharding.is_equivalent_to(
        NamedSharding(part.mesh, P("data", *lead, "model", None, None)), kv.ndim
    )
    got = jax.tree.map(lambda x: x.sharding, cache)
    same = jax.tree.map(lambda g, w, x: g.is_equivalent_to(w, x.ndim), got, want_sh, cache)
    assert all(jax.tree.leaves(same)), (got, want_sh)


# --- what a decode step costs: the compiled while body -------------------------------------


def _while_body_ops(hlo: str, nested: bool = False) -> list[tuple[str, str, set[str]]]:
    """(output shape, opcode, opcodes inside a fusion) of each instruction of the body of the
    entry computation's first while loop (the decoding loop), or with `nested` of the first
    while loop inside that body, in compiled HLO text."""
    comps = {m[1]: m[2] for m in re.finditer(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)}
    entry = hlo[hlo.index("\nENTRY ") :]
    body = re.search(r"body=(%[\w.\-]+)", entry[entry.index(" while(") :])[1]
    if nested:
        body = re.search(r" while\(.*?body=(%[\w.\-]+)", comps[body])[1]
    ops = []
    for line in comps[body].splitlines():
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+\[[\d,]*\])\S* ([\w\-]+)\(", line)
        if m:
            called = re.search(r"calls=(%[\w.\-]+)", line)
            fused = comps.get(called[1], "") if called else ""
            ops.append((m[1], m[2], set(re.findall(r"= \S+ ([\w\-]+)\(", fused))))
    return ops


def test_decode_step_reads_caches_in_place_and_never_projects_the_encoder():
    """The greedy loop body writes each self-attention cache by a scatter in place, copies or
    transposes no cache (self or cross-attention), and holds no encoder-output projection."""
    model = _model("t5", decoding_method="greedy")
    hlo = jax.jit(model.predict_batch).lower(_params("t5")[0], _batch("t5")).compile().as_text()
    h, k, d = T5_TINY.num_heads, T5_TINY.head_dim, T5_TINY.emb_dim
    # Keys [B, H, length, K], values [B, H, K, length]: self (L) and cross-attention (S).
    caches = {f"f32[{B},{h},{n},{k}]" for n in (L, S)} | {f"f32[{B},{h},{k},{n}]" for n in (L, S)}
    ops = _while_body_ops(hlo)
    on_caches = [(op, inner) for shape, op, inner in ops if shape in caches]
    assert {op for op, _ in on_caches} == {"get-tuple-element", "fusion"}, on_caches
    fusions = [inner for op, inner in on_caches if op == "fusion"]
    # One scatter per self-attention cache array (keys and values of each layer), no more.
    assert len(fusions) == 2 * T5_TINY.num_decoder_layers
    assert all("scatter" in inner and not inner & {"copy", "transpose"} for inner in fusions)
    assert not [op for shape, op, _ in ops if shape == f"f32[{B},{S},{d}]"]  # encoder output


def test_move_cache_copies_only_extra_children_into_childless_rows():
    """Each new beam reads its parent's cache row; a parent's first child keeps the parent's
    row, only further children are copied, into the rows of beams that left no child."""
    rng = np.random.RandomState(0)
    b, w = 64, 4
    cache = {"k": jnp.asarray(rng.randn(b * w, 3, 2), jnp.float32), "i": jnp.arange(b * w)}
    slot = np.stack([rng.permutation(w) for _ in range(b)]).astype(np.int32)
    origin = rng.randint(0, w, (b, w)).astype(np.int32)
    origin[0] = np.arange(w)  # every beam continues itself: nothing moves
    origin[1] = 2  # one parent for all: three copies
    moved, new_slot = jax.jit(decoding._move_cache)(cache, jnp.asarray(slot), jnp.asarray(origin))
    new_slot = np.asarray(new_slot)
    rows = lambda s: (np.arange(b)[:, None] * w + s).reshape(-1)
    parent_rows = rows(np.take_along_axis(slot, origin, axis=1))
    for name in cache:  # beam w now reads what its parent read
        np.testing.assert_array_equal(np.asarray(moved[name])[rows(new_slot)],
                                      np.asarray(cache[name])[parent_rows])  # fmt: skip
    assert all(sorted(r) == list(range(w)) for r in new_slot.tolist())  # a row per beam
    changed = (np.asarray(moved["i"]) != np.arange(b * w)).reshape(b, w).sum(1)
    distinct = np.array([len(set(r)) for r in origin.tolist()])
    np.testing.assert_array_equal(changed, w - distinct)
    assert changed[0] == 0 and changed[1] == 3 and new_slot[0].tolist() == slot[0].tolist()


def test_beam_step_moves_only_the_rows_of_extra_children():
    """The beam loop body writes each self-attention cache array by one scatter in place and
    never gathers, selects or copies a whole cache (reordering it by parent beam did both at
    every step); the rows of further children are copied by a nested loop, one row per
    example at a time, in place, and with the batch sharded without any collective."""
    require_devices(8)
    w = 3
    model = _model("t5", decoding_method="beam", beam_size=w)
    params, axes = _params("t5")
    batch = _batch("t5")
    hlo = jax.jit(model.predict_batch).lower(params, batch).compile().as_text()
    h, k, n_layers = T5_TINY.num_heads, T5_TINY.head_dim, T5_TINY.num_decoder_layers
    caches = {f"f32[{B * w},{h},{L},{k}]", f"f32[{B * w},{h},{k},{L}]"}
    ops = _while_body_ops(hlo)
    on_caches = [(op, inner) for shape, op, inner in ops if shape in caches]
    writes = [inner for op, inner in on_caches if op == "fusion"]
    assert {op for op, _ in on_caches} == {"get-tuple-element", "fusion"}, on_caches
    assert len(writes) == 2 * n_layers  # keys and values of each layer
    assert all("scatter" in inner and not inner & {"copy", "gather", "select"} for inner in writes)
    # The nested loop: whole caches only viewed (bitcasts) and written in place; what it
    # reads is one row per example.
    size = lambda shape: int(np.prod([int(d) for d in re.findall(r"\d+", shape.split("[")[1])]))
    row_size = h * L * k
    inner = _while_body_ops(hlo, nested=True)
    big = [(op, fused) for shape, op, fused in inner if size(shape) >= B * w * row_size]
    assert {op for op, _ in big} == {"get-tuple-element", "bitcast", "fusion"}, big
    fusions = [fused for op, fused in big if op == "fusion"]
    assert len([f for f in fusions if "scatter" in f]) >= 2 * n_layers
    assert not set().union(*fusions) & {"copy", "gather", "transpose", "select"}
    reads = [shape for shape, _, fused in inner if "gather" in fused and shape.startswith("f32")]
    assert len(reads) == 2 * n_layers and {size(r) for r in reads} == {B * row_size}
    # The batch over 'data': copies stay on the devices holding the example.
    part = _partitioner((4, 2), "megatron")
    batch_sh = {name: NamedSharding(part.mesh, P("data")) for name in batch}
    predict = part.partition(
        model.predict_batch, in_shardings=(part.shardings(params, axes), batch_sh),
        out_shardings=None,
    )  # fmt: skip
    sharded = predict.lower(params, batch).compile().as_text()
    assert not [op for _, op, _ in _while_body_ops(sharded, nested=True) if op.startswith("all-")]
