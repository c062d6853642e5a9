"""t5x's own decoding test cases (t5x/decoding_test.py), through t5lite's documented t5x options.

Each case keeps t5x's inputs and expected outputs; the t5x options it needs are named in the
call: `order="best_last"` (t5x's ascending order, equal scores broken as t5x does),
`max_decode_steps_after_prompt=True` (t5x counts `max_decode_steps` after the prompt),
`max_decode_steps_hard_limit`, `rescale_log_probs=True` (t5x's sample scores),
`state_callback_fn`, `logit_callback_fn`, and beam search's `min_log_prob` and
`brevity_counts_prompt=True` (t5x's penalty length after a prefilled prompt); t5x's beam
`max_decode_step` is t5lite's `max_decode_steps`. Coordinates: t5x's sequences and t5lite's are
the same for these calls (the prompt at positions 1.., results without the start slot).
docs/differences.md lists what has no option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.model import decoding

NEG_INF = -1.0e7
EOS_ID = 1


def _constant(logits_BV, copies):
    """A `tokens_to_logits` that returns the same logits for every step, per example."""
    logits = jnp.repeat(jnp.asarray(logits_BV, jnp.float32), copies, axis=0)
    return lambda state: (logits, state.cache)


def _markov_tokens_to_logits(batch_size, beam_size):
    """t5x's `test_beam_search` toy problem: a first-order Markov model over A, B, START, END
    whose two best sequences tie."""
    ab = np.asarray(
        [[[1, -1], [-1, 1]], [[-1, 1], [1, -1]], [[1, -1], [-1, 1]], [[-1, 1], [1, -1]]]
    )
    edges = np.ones([6, 5, 5]) * NEG_INF
    edges[1:5, 1:3, 1:3] = ab
    edges[0, 3, 1] = edges[0, 3, 2] = 0  # START -> A or B
    edges[5, 1, 4] = edges[5, 2, 4] = 0  # A or B -> END
    edges[:, 0, :] = 0  # PAD -> anything
    edges = jnp.asarray(edges)[None]
    logits0 = jnp.asarray([NEG_INF, NEG_INF, NEG_INF, 0, NEG_INF])[None]
    n = batch_size * beam_size

    def tokens_to_logits(state):
        cur_iter = state.cache["cur_iter"]
        t = jnp.maximum(0, cur_iter[:, 0].astype(jnp.int32) - 1).reshape(n, 1, 1, 1)
        step_edges = jnp.squeeze(jnp.take_along_axis(edges, t, axis=1), axis=1)
        one_hot = jax.nn.one_hot(state.cur_token, 5, axis=1).reshape(n, 1, 5)
        logits = jnp.squeeze(jnp.matmul(one_hot, step_edges), axis=1)
        logits = jnp.where(cur_iter == 0, logits0, logits)
        return logits, {"cur_iter": cur_iter + 1}

    return tokens_to_logits


def test_beam_search_equal_scores_in_t5x_order():
    """t5x test_beam_search: START-AABBA-END and START-BBAAB-END tie; t5x returns them in
    this order."""
    states = ["PAD", "A", "B", "START-", "-END"]
    seqs, scores = decoding.beam_search(
        jnp.zeros([2, 7], jnp.int32),
        {"cur_iter": jnp.zeros((2, 1))},
        _markov_tokens_to_logits(2, 2),
        beam_size=2,
        alpha=0.0,
        eos_id=4,
        order="best_last",
    )
    strings = ["".join(states[t] for t in seqs[0, i]) for i in range(2)]
    assert strings == ["START-AABBA-END", "START-BBAAB-END"]
    assert float(scores[0, 0]) == float(scores[0, 1])


LOGITS_2_THEN_3 = [
    [-1e7, -1e10, -0.1, -0.9, -1e4, -1e4, -1e4, -1e4],
    [-1e7, -1e10, -0.9, -0.1, -1e4, -1e4, -1e4, -1e4],
]
LOGITS_WITH_EOS = [
    [-1e7, -1e10, -0.1, -0.9, -1e4, -1e4, -1e4, -1e4],
    [-1e7, -1.0, -0.9, -0.1, -1e4, -1e4, -1e4, -1e4],
]


def _expected_scores(expected, logits, prompts):
    """t5x's reference: the sum of the log-probabilities of the non-prompt, non-pad tokens."""
    out = []
    for beams, row_logits, prompt in zip(expected, np.asarray(logits), prompts):
        logp = np.asarray(jax.nn.log_softmax(row_logits))
        out.append(
            [sum(logp[t] for t, p in zip(beam, prompt) if p == 0 and t != 0) for beam in beams]
        )
    return np.array(out)


def test_beam_search_force_decode_prefix():
    """t5x test_beam_search_force_decode_prefix: the second beams tie (one 3 among 2s)."""
    inputs = np.array([[0, 7, 0, 0, 0], [0, 4, 5, 0, 0]], np.int32)
    seqs, scores = decoding.beam_search(
        inputs, {}, _constant(LOGITS_2_THEN_3, 2), beam_size=2, alpha=0.0, order="best_last"
    )
    expected = [[[7, 3, 2, 2, 2], [7, 2, 2, 2, 2]], [[4, 5, 2, 3, 3], [4, 5, 3, 3, 3]]]
    np.testing.assert_array_equal(seqs, expected)
    assert np.all(np.diff(np.asarray(scores)) >= 0)
    prompts = [[7, 0, 0, 0, 0], [4, 5, 0, 0, 0]]
    want = _expected_scores(expected, LOGITS_2_THEN_3, prompts)
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_beam_search_force_decode_no_prefix():
    logits = [[-1e7, -1e10, -0.1, -0.9], [-1e7, -1e10, -0.9, -0.1]]
    seqs, scores = decoding.beam_search(
        np.zeros((2, 5), np.int32), {}, _constant(logits, 2), beam_size=2, order="best_last"
    )
    expected = [[[3, 2, 2, 2, 2], [2, 2, 2, 2, 2]], [[2, 3, 3, 3, 3], [3, 3, 3, 3, 3]]]
    np.testing.assert_array_equal(seqs, expected)
    assert np.all(np.diff(np.asarray(scores)) >= 0)


def test_beam_search_force_decode_prefix_with_initial_index():
    inputs = np.array([[0, 7, 0, 0, 0], [0, 4, 5, 0, 0]], np.int32)
    fed = []

    def tokens_to_logits(state):
        fed.append(np.asarray(state.cur_token))
        return _constant(LOGITS_WITH_EOS, 2)(state)

    with jax.disable_jit():  # to see the first tokens fed
        seqs, scores = decoding.beam_search(
            inputs,
            {},
            tokens_to_logits,
            beam_size=2,
            alpha=0.0,
            initial_index=np.array([1, 2], np.int32),
            order="best_last",
        )
    np.testing.assert_array_equal(fed[0], [[7], [7], [5], [5]])
    expected = [[[7, 3, 2, 2, 2], [7, 2, 2, 2, 2]], [[4, 5, 3, 1, 0], [4, 5, 1, 0, 0]]]
    np.testing.assert_array_equal(seqs, expected)
    assert np.all(np.diff(np.asarray(scores)) >= 0)
    prompts = [[7, 0, 0, 0, 0], [4, 5, 0, 0, 0]]
    want = _expected_scores(expected, LOGITS_WITH_EOS, prompts)
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_beam_search_max_decode_step():
    """t5x test_beam_search_max_decode_step: t5x's `max_decode_step` (search steps from where
    decoding starts) is t5lite's `max_decode_steps` as counted by default."""
    logits = [[-1e7, -1e10, -0.1, -0.9], [-1e7, -1e10, -0.9, -0.1]]
    seqs, scores = decoding.beam_search(
        np.zeros((2, 5), np.int32),
        {},
        _constant(logits, 2),
        beam_size=2,
        max_decode_steps=2,
        order="best_last",
    )
    expected = [[[3, 2, 0, 0, 0], [2, 2, 0, 0, 0]], [[2, 3, 0, 0, 0], [3, 3, 0, 0, 0]]]
    np.testing.assert_array_equal(seqs, expected)
    assert np.all(np.diff(np.asarray(scores)) >= 0)
    # No beam finished: t5x returns the live beams with their plain log-probabilities.
    np.testing.assert_allclose(scores, _expected_scores(expected, logits, np.zeros((2, 5))))


def test_beam_search_force_decode_prefix_with_initial_index_max_decode_step():
    """t5x's case of that name: row 0 never finishes and stops after 2 steps; row 1 finishes."""
    inputs = np.array([[0, 7, 0, 0, 0], [0, 4, 5, 0, 0]], np.int32)
    seqs, scores = decoding.beam_search(
        inputs,
        {},
        _constant(LOGITS_WITH_EOS, 2),
        beam_size=2,
        alpha=0.0,
        initial_index=np.array([1, 2], np.int32),
        max_decode_steps=2,
        order="best_last",
    )
    expected = [[[7, 3, 2, 0, 0], [7, 2, 2, 0, 0]], [[4, 5, 3, 1, 0], [4, 5, 1, 0, 0]]]
    np.testing.assert_array_equal(seqs, expected)
    assert np.all(np.diff(np.asarray(scores)) >= 0)
    prompts = [[7, 0, 0, 0, 0], [4, 5, 0, 0, 0]]
    np.testing.assert_allclose(
        scores, _expected_scores(expected, LOGITS_WITH_EOS, prompts), atol=1e-5
    )


def _gnmt(alpha, length):
    return ((5.0 + length) / 6.0) ** alpha


@pytest.mark.parametrize("counts_prompt", [False, True])
def test_beam_search_brevity_penalty_after_a_prefilled_prompt(counts_prompt):
    """t5x's beam search divides a finished beam's log-probability by the penalty of
    `initial_index + steps` (its lengths = initial_index + cur_index + 1): the prefilled prompt
    counts. `brevity_counts_prompt=True` gives that; t5lite's default counts the steps only.
    t5x's `force_decode_prefix_with_initial_index` case, with alpha 0.6."""
    inputs = np.array([[0, 7, 0, 0, 0], [0, 4, 5, 0, 0]], np.int32)
    alpha = 0.6
    seqs, scores = decoding.beam_search(
        inputs,
        {},
        _constant(LOGITS_WITH_EOS, 2),
        beam_size=2,
        alpha=alpha,
        initial_index=np.array([1, 2], np.int32),
        brevity_counts_prompt=counts_prompt,
        order="best_last",
    )
    expected = [[[7, 3, 2, 2, 2], [7, 2, 2, 2, 2]], [[4, 5, 3, 1, 0], [4, 5, 1, 0, 0]]]
    np.testing.assert_array_equal(seqs, expected)
    prompts = [[7, 0, 0, 0, 0], [4, 5, 0, 0, 0]]
    logp = _expected_scores(expected, LOGITS_WITH_EOS, prompts)
    # Row 0 never finishes: its live beams, unpenalised. Row 1's EOS comes after 2 and 1
    # generated tokens, behind a prompt of 2 (initial_index).
    generated = np.array([2, 1])
    length = generated + 2 if counts_prompt else generated
    np.testing.assert_allclose(scores[0], logp[0], atol=1e-5)
    np.testing.assert_allclose(scores[1], logp[1] / _gnmt(alpha, length), atol=1e-5)
    # Without initial_index (the prompt forced, t5x's initial_index = 0) both count the same.
    plain = [
        decoding.beam_search(
            inputs, {}, _constant(LOGITS_WITH_EOS, 2), beam_size=2, brevity_counts_prompt=c
        )[1]
        for c in (False, True)
    ]
    np.testing.assert_array_equal(plain[0], plain[1])


def test_model_brevity_counts_prompt_reaches_beam_search():
    from t5lite.model import models

    inputs = np.array([[0, 7, 0, 0, 0], [0, 4, 5, 0, 0]], np.int32)
    initial_index = np.array([1, 2], np.int32)
    args = (inputs, {}, _constant(LOGITS_WITH_EOS, 2), None, initial_index, None, None)
    got = {}
    for counts in (False, True):
        model = models.DecoderOnlyModel(
            decoding_method="beam", beam_size=2, alpha=0.6, brevity_counts_prompt=counts
        )
        got[counts] = np.asarray(model._decode(*args)[1])
    want = decoding.beam_search(
        *args[:3], beam_size=2, alpha=0.6, initial_index=initial_index, brevity_counts_prompt=True
    )[1]
    np.testing.assert_array_equal(got[True], want)
    assert got[True][1, 0] > got[False][1, 0]  # a longer length: a larger divisor


def test_beam_search_min_log_prob():
    """t5x test_beam_search_min_log_prob: no live beam stays above -0.05 after one step."""
    logits = [[-1e7, -1e10, -0.1, -0.9], [-1e7, -1e10, -0.9, -0.1]]
    seqs, scores = decoding.beam_search(
        np.zeros((2, 5), np.int32),
        {},
        _constant(logits, 2),
        beam_size=2,
        min_log_prob=-0.05,
        order="best_last",
    )
    expected = [[[3, 0, 0, 0, 0], [2, 0, 0, 0, 0]], [[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]]]
    np.testing.assert_array_equal(seqs, expected)
    assert np.all(np.diff(np.asarray(scores)) >= 0)
    # Per row and traced: a limit only row 1 misses stops row 1 alone.
    limits = jnp.array([-10.0, -0.05])
    seqs, _ = jax.jit(
        lambda m: decoding.beam_search(
            np.zeros((2, 5), np.int32), {}, _constant(logits, 2), beam_size=2, min_log_prob=m
        )
    )(limits)
    np.testing.assert_array_equal(seqs[1], [[3, 0, 0, 0, 0], [2, 0, 0, 0, 0]])
    assert (np.asarray(seqs[0]) != 0).all()


def test_temperature_sample_with_state_callback():
    """t5x test_temperature_sample_with_state_callback: the callback writes EOS after the
    first 3, which forces it and ends the row."""
    logits = [[-1e7, -1e7, -1e7, 0], [-1e7, -1e7, -1e7, 0]]

    def callback(current_index, sequences):
        sequences = np.array(sequences)
        for i, j in enumerate(np.asarray(current_index)):
            # t5lite's sequences hold the token fed at j in column j - 1 (no start slot).
            if j >= 1 and j < sequences.shape[1] and sequences[i, j - 1] == 3:
                sequences[i, j] = EOS_ID
        return sequences

    def state_callback_fn(state):
        sequences = jax.experimental.io_callback(
            callback,
            jax.ShapeDtypeStruct(state.sequences.shape, state.sequences.dtype),
            state.cur_index,
            state.sequences,
        )
        return state.replace(sequences=sequences)

    inputs = np.array([[0, 5, 6, 7, 0], [0, 8, 9, 0, 0]], np.int32)
    seqs, _ = decoding.temperature_sample(
        inputs, {}, _constant(logits, 1), temperature=0.0, state_callback_fn=state_callback_fn
    )
    np.testing.assert_array_equal(seqs[:, 0], [[5, 6, 7, 3, EOS_ID], [8, 9, 3, EOS_ID, 0]])


MAX_STEPS_LOGITS = [[-1e7, -1e7, -1e7, 0], [-1e7, -1e7, -1e7, 0]]


@pytest.mark.parametrize(
    ("initial_index", "expected_calls"),
    [(None, 6), (np.array([1, 2]), 4), (np.array([1, 1]), 5)],
    ids=["no_initial_index", "initial_index", "lower_initial_index"],
)
def test_temperature_sample_max_decode_steps_with_initial_index(initial_index, expected_calls):
    inputs = np.array([[0, 2, 0, 0, 0, 0, 0, 0], [0, 2, 2, 0, 0, 0, 0, 0]], np.int32)
    calls = []

    def tokens_to_logits(state):
        calls.append(1)
        return _constant(MAX_STEPS_LOGITS, 1)(state)

    with jax.disable_jit():  # to count the calls
        seqs, scores = decoding.temperature_sample(
            inputs,
            {},
            tokens_to_logits,
            initial_index=initial_index,
            top_k=4,
            max_decode_steps=4,
            max_decode_steps_after_prompt=True,
        )
    assert len(calls) == expected_calls
    expected = [[2, 3, 3, 3, 3, 0, 0, 0], [2, 2, 3, 3, 3, 3, 0, 0]]
    np.testing.assert_array_equal(seqs[:, 0], expected)
    np.testing.assert_array_equal(scores, [[0.0], [0.0]])


def test_temperature_sample_max_decode_steps_endpad():
    inputs = np.array(
        [[0, 2, 0, 0, 0, 0, 0, 0], [0, 2, 2, 2, 2, 2, 2, 0], [0, 2, 2, 2, 0, 0, 0, 0]], np.int32
    )
    logits = MAX_STEPS_LOGITS + MAX_STEPS_LOGITS[:1]
    calls = []

    def tokens_to_logits(state):
        calls.append(1)
        return _constant(logits, 1)(state)

    with jax.disable_jit():
        seqs, scores = decoding.temperature_sample(
            inputs,
            {},
            tokens_to_logits,
            initial_index=np.array([1, 6, 0]),
            top_k=4,
            max_decode_steps=4,
            max_decode_steps_after_prompt=True,
        )
    # Row 2 starts at 0: 3 calls through its prompt, 4 more after it.
    assert len(calls) == 7
    expected = [[2, 3, 3, 3, 3, 0, 0, 0], [2, 2, 2, 2, 2, 2, 3, 3], [2, 2, 2, 3, 3, 3, 3, 0]]
    np.testing.assert_array_equal(seqs[:, 0], expected)
    np.testing.assert_allclose(scores, [[0.0], [0.0], [0.0]])


HARD_LIMIT_INPUTS = np.array([[0, 2, 0, 0, 0, 0, 0, 0], [0, 2, 2, 0, 0, 0, 0, 0]], np.int32)
CLIPPED_TO_4 = [[2, 3, 3, 3, 3, 0, 0, 0], [2, 2, 3, 3, 3, 3, 0, 0]]
UNCLIPPED = [[2, 3, 3, 3, 3, 3, 3, 3], [2, 2, 3, 3, 3, 3, 3, 3]]


def test_temperature_sample_max_decode_steps_hard_limit():
    """t5x test_temperature_sample_max_decode_steps_hard_limit: 10 steps clipped to 4."""
    seqs, scores = decoding.temperature_sample(
        HARD_LIMIT_INPUTS,
        {},
        _constant(MAX_STEPS_LOGITS, 1),
        top_k=4,
        max_decode_steps=10,
        max_decode_steps_hard_limit=4,
        max_decode_steps_after_prompt=True,
    )
    np.testing.assert_array_equal(seqs[:, 0], CLIPPED_TO_4)
    np.testing.assert_array_equal(scores, [[0.0], [0.0]])


@pytest.mark.parametrize(
    ("steps", "hard_limit", "expected"),
    [
        (10, None, UNCLIPPED),
        (10, 0, UNCLIPPED),  # t5x: a limit <= 0 is no limit
        (10, -1, UNCLIPPED),
        (None, 4, UNCLIPPED),  # t5x: the limit clips max_decode_steps only, never sets it
        (3, 4, [[2, 3, 3, 3, 0, 0, 0, 0], [2, 2, 3, 3, 3, 0, 0, 0]]),  # below the limit
    ],
)
def test_temperature_sample_max_decode_steps_hard_limit_when_set(steps, hard_limit, expected):
    seqs, _ = decoding.greedy(
        HARD_LIMIT_INPUTS,
        {},
        _constant(MAX_STEPS_LOGITS, 1),
        max_decode_steps=steps,
        max_decode_steps_hard_limit=hard_limit,
        max_decode_steps_after_prompt=True,
    )
    np.testing.assert_array_equal(seqs[:, 0], expected)


def test_max_decode_steps_hard_limit_bounds_traced_steps_and_reaches_the_model():
    """The limit is static and bounds a traced `max_decode_steps`; a model takes it as a
    `decoder_params` entry (t5x passes `decoder_params` to its decode function)."""
    from t5lite.model import models

    run = jax.jit(
        lambda steps: decoding.temperature_sample(
            HARD_LIMIT_INPUTS,
            {},
            _constant(MAX_STEPS_LOGITS, 1),
            temperature=0.0,
            max_decode_steps=steps,
            max_decode_steps_hard_limit=4,
            max_decode_steps_after_prompt=True,
        )[0]
    )
    np.testing.assert_array_equal(run(jnp.int32(10))[:, 0], CLIPPED_TO_4)
    with pytest.raises(ValueError, match="max_decode_steps_hard_limit must be a Python int"):
        decoding.greedy(
            HARD_LIMIT_INPUTS,
            {},
            _constant(MAX_STEPS_LOGITS, 1),
            max_decode_steps=10,
            max_decode_steps_hard_limit=jnp.int32(4),
        )
    initial_index = np.array([1, 2])  # decoding from the end of the prompt, as the model does
    for method in ("greedy", "sample"):
        model = models.DecoderOnlyModel(decoding_method=method, num_decodes=1, top_k=1)
        args = (HARD_LIMIT_INPUTS, {}, _constant(MAX_STEPS_LOGITS, 1), None, initial_index, 10)
        seqs, _ = model._decode(*args, {"max_decode_steps_hard_limit": 4})
        np.testing.assert_array_equal(seqs[:, 0], CLIPPED_TO_4)
    beam = models.DecoderOnlyModel(decoding_method="beam", beam_size=1)
    with pytest.raises(ValueError, match=r"\['max_decode_steps_hard_limit'\] do not apply"):
        beam._decode(*args, {"max_decode_steps_hard_limit": 4})


@pytest.mark.parametrize("after_prompt", [False, True])
def test_temperature_sample_max_decode_steps_docstring_ex4(after_prompt):
    """Decoding from the end of the prompt: both counts agree."""
    inputs = np.array([[0, 2, 0, 0, 0, 0, 0, 0], [0, 3, 4, 0, 0, 0, 0, 0]], np.int32)
    logits = [[-1e7, -1e7, 0, -1e7], [-1e7, -1e7, -1e7, 0]]
    seqs, _ = decoding.temperature_sample(
        inputs,
        {},
        _constant(logits, 1),
        initial_index=np.array([1, 2]),
        top_k=4,
        max_decode_steps=2,
        max_decode_steps_after_prompt=after_prompt,
    )
    expected = [[2, 2, 2, 0, 0, 0, 0, 0], [3, 4, 3, 3, 0, 0, 0, 0]]
    np.testing.assert_array_equal(seqs[:, 0], expected)


def test_beam_search_max_decode_steps_after_prompt():
    """The same count for beam search: 2 steps after each row's prompt."""
    inputs = np.array([[0, 7, 0, 0, 0, 0], [0, 4, 5, 0, 0, 0]], np.int32)
    seqs, _ = decoding.beam_search(
        inputs,
        {},
        _constant(LOGITS_2_THEN_3, 2),
        beam_size=2,
        alpha=0.0,
        max_decode_steps=2,
        max_decode_steps_after_prompt=True,
        order="best_last",
    )
    np.testing.assert_array_equal(
        seqs, [[[7, 3, 2, 0, 0, 0], [7, 2, 2, 0, 0, 0]], [[4, 5, 2, 3, 0, 0], [4, 5, 3, 3, 0, 0]]]
    )


def test_model_decode_order_and_min_log_prob_reach_beam_search():
    """`decode_order='best_last'` and `min_log_prob` (field or `decoder_params`) of a model are
    t5x's beam-search options; the best decode of 'best_last' is the last one."""
    from t5lite.model import models

    model = models.DecoderOnlyModel(
        decoding_method="beam",
        beam_size=2,
        alpha=0.0,
        decode_order="best_last",
        min_log_prob=-0.05,
    )
    prompt = np.zeros((2, 5), np.int32)
    logits = [[-1e7, -1e10, -0.1, -0.9], [-1e7, -1e10, -0.9, -0.1]]
    args = (prompt, {}, _constant(logits, 2), None, None, None)
    seqs, scores = model._decode(*args, None)
    expected = [[[3, 0, 0, 0, 0], [2, 0, 0, 0, 0]], [[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]]]
    np.testing.assert_array_equal(seqs, expected)
    best, aux = model._best_or_all(seqs, scores, return_all=False)
    np.testing.assert_array_equal(best, [[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]])
    assert float(aux["scores"][0]) == float(np.max(scores[0]))
    seqs, _ = model._decode(*args, {"min_log_prob": -100.0})
    np.testing.assert_array_equal(seqs[:, -1], [[2, 2, 2, 2, 2], [3, 3, 3, 3, 3]])


@pytest.mark.parametrize(
    ("prompt", "rescale", "expected", "score"),
    [
        ([0, 2, 2, 2, 0], True, [2, 2, 2, 2, 2], 0.0),
        ([0, 2, 2, 3, 0], False, [2, 2, 3, 2, 2], -1.02165125),
    ],
)
def test_greedy_decoding_topk_sample_log_probs(prompt, rescale, expected, score):
    """t5x's test of that name: with `rescale_log_probs` (t5x's default) top_k=1 scores every
    token 0; without it, the model's log-probability (2 x log 0.6)."""
    logits = [[-1e7, -1e7, -0.510825624, -0.916290732]]  # 2 and 3 at 0.6 and 0.4
    seqs, scores = decoding.temperature_sample(
        np.array([prompt], np.int32),
        {},
        _constant(logits, 1),
        top_k=1,
        rescale_log_probs=rescale,
    )
    np.testing.assert_array_equal(seqs[:, 0], [expected])
    np.testing.assert_allclose(scores[:, 0], [score], atol=1e-6)


def test_rescaled_scores_are_those_of_the_distribution_sampled_from():
    """t5x's rescale_log_probs: log_softmax of the logits / temperature after top-p (t5x's
    test_topp_log_probs masks (0.3, 0, 0.1, 0.6) at temperature 1.4 and top-p 0.7 to
    [-0.857, NEG_INF, NEG_INF, -0.364]); greedy rows (temperature 0) score 0."""
    logits = np.array([[-1.2, NEG_INF, -2.3, -0.51]] * 2, np.float32)
    seqs, scores = decoding.temperature_sample(
        np.zeros((2, 6), np.int32),
        {},
        _constant(logits, 1),
        temperature=jnp.array([1.4, 0.0]),
        top_p=0.7,
        rescale_log_probs=True,
        eos_id=-1,
    )
    masked = np.array([-0.85714293, -np.inf, -np.inf, -0.36428571])
    logp = masked - np.log(np.sum(np.exp(masked[np.isfinite(masked)])))
    np.testing.assert_allclose(scores[0, 0], sum(logp[t] for t in seqs[0, 0]), rtol=1e-5)
    assert set(np.asarray(seqs[0, 0]).tolist()) <= {0, 3}  # top-p keeps tokens 0 and 3
    np.testing.assert_array_equal(seqs[1, 0], [3] * 6)
    assert float(scores[1, 0]) == 0.0
    # The default scores the same tokens by the model's own distribution.
    _, raw = decoding.temperature_sample(
        np.zeros((2, 6), np.int32),
        {},
        _constant(logits, 1),
        temperature=jnp.array([1.4, 0.0]),
        top_p=0.7,
        eos_id=-1,
    )
    model_logp = np.asarray(jax.nn.log_softmax(logits[0]))
    np.testing.assert_allclose(raw[0, 0], sum(model_logp[t] for t in seqs[0, 0]), rtol=1e-5)


def test_temperature_sample_with_logit_callback():
    """t5x test_temperature_sample_with_logit_callback: the callback makes 2 (row 0) and 3
    (row 1) the only likely tokens after the prompt."""

    def logit_callback_fn(logits, state):
        del state
        return logits.at[0, 2].set(0.0).at[1, 3].set(0.0)

    inputs = np.array([[0, 5, 6, 7, 0], [0, 8, 9, 0, 0]], np.int32)
    seqs, scores = decoding.temperature_sample(
        inputs,
        {},
        _constant([[-1e7] * 4] * 2, 1),
        temperature=0.0,
        logit_callback_fn=logit_callback_fn,
    )
    np.testing.assert_array_equal(seqs[:, 0], [[5, 6, 7, 2, 2], [8, 9, 3, 3, 3]])
    np.testing.assert_allclose(scores, [[0.0], [0.0]], atol=1e-6)  # scored after the callback


def test_model_rescale_log_probs_is_a_decoder_param():
    from t5lite.model import models

    logits = [[-1e7, -1e7, -0.510825624, -0.916290732]]
    args = (np.zeros((1, 3), np.int32), {}, _constant(logits, 1), None, None, None)
    for method in ("greedy", "sample"):
        model = models.DecoderOnlyModel(decoding_method=method, top_k=1)
        _, raw = model._decode(*args, None)
        _, rescaled = model._decode(*args, {"rescale_log_probs": True})
        np.testing.assert_allclose(raw, [[3 * np.log(0.6)]], rtol=1e-6)
        np.testing.assert_array_equal(rescaled, [[0.0]])


def test_temperature_sample_per_item_temperature():
    """t5x's case of that name: top-p 0.63 after temperatures below 0.8 keeps one token; its
    scores are 0 with t5x's (default) rescaled log-probabilities."""
    logits = np.repeat(
        np.array(
            [
                [-1.2, -1e7, -2.3, -0.51],  # (0.3, 0, 0.1, 0.6)
                [-0.51, -1.2, -1e7, -2.3],
                [-1.2, -1e7, -0.51, -2.3],
                [-1.2, -0.51, -1e7, -2.3],
            ],
            np.float32,
        ),
        2,
        axis=0,
    )
    seqs, scores = decoding.temperature_sample(
        np.zeros((4, 20), np.int32),
        {},
        lambda state: (jnp.asarray(logits), state.cache),
        temperature=np.array([0.5, 0, 0.3, 0.2]),
        top_p=0.63,
        num_decodes=2,
        rescale_log_probs=True,
    )
    expected = np.array([[3] * 20, [0] * 20, [2] * 20, [EOS_ID] + [0] * 19])
    np.testing.assert_array_equal(seqs, np.repeat(expected[:, None], 2, axis=1))
    np.testing.assert_array_equal(scores, np.zeros((4, 2)))


def test_dynamic_topp_max_decode_steps():
    """t5x's case of that name: temperature, top-p and max_decode_steps traced."""
    run = jax.jit(
        lambda t, p, m: decoding.temperature_sample(
            np.zeros((1, 20), np.int32),
            {},
            _constant([[-1.2, -1e7, -2.3, -0.51]], 1),
            temperature=t,
            top_p=p,
            max_decode_steps=m,
            rescale_log_probs=True,
        )
    )
    seqs, scores = run(0.8, 0.63, 10)
    np.testing.assert_array_equal(seqs, [[[3] * 10 + [0] * 10]])
    np.testing.assert_array_equal(scores, [[0.0]])
