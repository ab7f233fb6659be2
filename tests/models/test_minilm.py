"""apir.models.minilm: the ggml graph's embeddings against the independent numpy model."""

import numpy as np
import pytest

from apir.models.minilm import MiniLM
from tests.models import reference

LONG = " ".join(
    "The committee reviewed the proposal in detail, weighing its costs against the expected "
    "benefits for the town's residents, and asked for a revised budget before the next meeting."
    for _ in range(12))

SENTENCES = [
    "Hi.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a white horse on an enclosed ground.",
    "Two men pushed carts through the woods while a monkey played a drum nearby.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons, "
    "mediated by the exchange of massless vector bosons that carry colour charge.",
    "In 1887 the engineers, having surveyed the river twice, finally agreed on where the bridge "
    "should stand; construction began the following spring and took nearly four years.",
    LONG,
]


def _cosine(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def embedded(minilm):
    return minilm.embed(SENTENCES, batch_size=4)


def test_sentences_cover_lengths_up_to_max(minilm):
    lengths = minilm.tokenize(SENTENCES).lengths
    assert len(set(lengths.tolist())) == len(SENTENCES) >= 8
    assert lengths.max() == minilm.config.max_seq_length == 256


def test_shape_dtype_unit_rows(embedded):
    assert embedded.shape == (len(SENTENCES), 384) and embedded.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embedded, axis=1), 1.0, atol=1e-5)


def test_matches_numpy_reference(minilm, weights64, embedded):
    # Batched with padding and masking (batch_size=4 mixes lengths) against one unpadded sentence
    # at a time in float64.
    tokens = minilm.tokenize(SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        n = tokens.lengths[i]
        ref = reference.sentence_embedding(weights64, minilm.config, tokens.ids[i, :n], tokens.type_ids[i, :n])
        cos = _cosine(embedded[i], ref)
        assert cos >= 0.9999, (i, n, cos)
        np.testing.assert_allclose(embedded[i], ref, atol=1e-5)  # measured: about 5e-8


def test_padding_does_not_change_result(minilm, embedded):
    # Each sentence alone (no padding) versus inside padded batches.
    for i in (0, 4, 7):
        alone = minilm.embed([SENTENCES[i]])[0]
        np.testing.assert_allclose(alone, embedded[i], atol=2e-5)


def test_batch_order_restored(minilm, embedded):
    # Same sentences reversed, other batch split: the rows follow the input order.
    rev = minilm.embed(SENTENCES[-2::-1], batch_size=3)[::-1]  # the 256-token one left out: time
    np.testing.assert_allclose(rev, embedded[:-1], atol=2e-5)


def test_similar_sentences_score_higher(embedded):
    sim = embedded @ embedded.T
    eating, bread, baby, horse, physics, committee = 1, 2, 3, 4, 6, 8
    assert sim[eating, bread] > 0.5  # a paraphrase pair
    assert sim[eating, bread] > max(sim[eating, baby], sim[bread, physics], sim[bread, committee]) + 0.3
    assert sim[eating, horse] > sim[baby, physics]  # two men doing things vs. unrelated topics


def test_upload_progress_reaches_total(assets):
    calls = []
    with MiniLM(assets=assets, progress=lambda done, total: calls.append((done, total))) as model:
        assert model.upload_bytes == assets.n_weight_bytes > 80e6
    assert calls[0] == (0, assets.n_weight_bytes) and calls[-1] == (assets.n_weight_bytes,) * 2
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and len(calls) > 20


def test_module_embed_on_given_backend(ggml, minilm):
    # The backend and buffer type are parameters: an explicitly created CPU backend.
    backend = ggml.ggml_backend_cpu_init()
    ggml.ggml_backend_cpu_set_n_threads(backend, 1)
    try:
        buft = ggml.ggml_backend_get_default_buffer_type(backend)
        with MiniLM(backend=backend, buft=buft, assets=minilm.assets) as model:
            got = model.embed(SENTENCES[:3])
        assert ggml.ggml_backend_name(backend) == b"CPU"
    finally:
        ggml.ggml_backend_free(backend)
    np.testing.assert_allclose(got, minilm.embed(SENTENCES[:3]), atol=1e-6)


def test_cpu_result_independent_of_thread_count(minilm):
    # Precondition for "remote equals local byte for byte": the host's ggml CPU may use another
    # thread count than this process.
    with MiniLM(assets=minilm.assets, n_threads=1) as one:
        got = one.embed(SENTENCES[:6], batch_size=3)
    assert np.array_equal(got, minilm.embed(SENTENCES[:6], batch_size=3))


def test_remote_equals_local_byte_for_byte(minilm, embedded):
    from apir.models.backends import BackendUnavailable, open_backend
    try:
        opened = open_backend(allow_fallback=False)  # the embedded APIR host
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    with opened, MiniLM(opened.backend, opened.buft, assets=minilm.assets) as remote:
        assert np.array_equal(remote.embed(SENTENCES, batch_size=4), embedded)


def test_empty_row_rejected(minilm):
    from apir.models.assets import TokenBatch

    ids = np.array([[101, 102], [0, 0]], np.int32)
    mask = np.array([[1, 1], [0, 0]], np.int32)
    with pytest.raises(ValueError):
        minilm.embed_tokens(TokenBatch(ids, ids * 0, mask))
