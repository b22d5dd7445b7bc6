"""Tests for pipelinerl_jax.packing: layout invariants, the model's view of packed rows, errors."""

import jax
import numpy as np
import pytest

from pipelinerl_jax import packing
from pipelinerl_jax.models import transformer


def random_sample(rng, p, c, vocab=50, with_ref=False):
  return packing.Sample(
      prompt_tokens=rng.integers(0, vocab, p),
      completion_tokens=rng.integers(0, vocab, c),
      behaviour_logprobs=-rng.random(c).astype(np.float32) * 3,
      versions=rng.integers(0, 9, c),
      advantage=float(rng.normal()),
      ref_logprobs=-rng.random(c).astype(np.float32) if with_ref else None)


def random_samples(rng, num, max_p, max_c, **kw):
  return [random_sample(rng, int(rng.integers(1, max_p + 1)), int(rng.integers(1, max_c + 1)), **kw)
          for _ in range(num)]


def simple_sample(p, c):
  """Prompt 1..p, completion 100..; logprob of completion token k is -(k+1)/10, version k."""
  return packing.Sample(np.arange(1, p + 1), np.arange(100, 100 + c),
                        -np.arange(1, c + 1) / 10, np.arange(c), advantage=0.5)


def check_layout(samples, batch, stats, seq_len):
  """Checks every per-sample and padding invariant of a packed batch against its samples."""
  keys = {'tokens', 'targets', 'positions', 'segment_ids', 'loss_mask', 'behaviour_logprobs',
          'advantages', 'versions', 'sample_index', 'segment_starts', 'segment_lengths'}
  if all(s.ref_logprobs is not None for s in samples):
    keys.add('ref_logprobs')
  assert set(batch) == keys
  starts, lengths = packing.segment_spans(batch['segment_ids'], seq_len)
  np.testing.assert_array_equal(batch['segment_starts'], starts)
  np.testing.assert_array_equal(batch['segment_lengths'], lengths)
  rows = stats.num_rows
  for key, x in batch.items():
    assert x.shape == (rows, seq_len), key
    assert x.dtype == (np.float32 if key in ('loss_mask', 'behaviour_logprobs', 'advantages',
                                             'ref_logprobs') else np.int32), key

  idx = batch['sample_index']
  truncated = 0
  for i, s in enumerate(samples):
    seq = np.concatenate([s.prompt_tokens, s.completion_tokens])
    n = min(len(seq) - 1, seq_len)
    truncated += len(seq) - 1 - n
    r_, t_ = np.nonzero(idx == i)
    assert len(set(r_)) == 1, f'sample {i} spans rows {set(r_)}'
    r, t = r_[0], t_
    assert len(t) == n and np.all(np.diff(t) == 1), f'sample {i} is not contiguous'
    np.testing.assert_array_equal(batch['positions'][r, t], np.arange(n))
    np.testing.assert_array_equal(batch['tokens'][r, t], seq[:n])
    np.testing.assert_array_equal(batch['targets'][r, t], seq[1:n + 1])
    seg = batch['segment_ids'][r, t]
    assert seg[0] > 0 and np.all(seg == seg[0])
    p = len(s.prompt_tokens)
    c = n - p + 1
    want_mask = (np.arange(n) >= p - 1).astype(np.float32)
    np.testing.assert_array_equal(batch['loss_mask'][r, t], want_mask)
    loss = t[p - 1:]
    np.testing.assert_array_equal(batch['behaviour_logprobs'][r, loss],
                                  s.behaviour_logprobs[:c].astype(np.float32))
    np.testing.assert_array_equal(batch['versions'][r, loss], s.versions[:c])
    np.testing.assert_array_equal(batch['advantages'][r, loss], np.float32(s.advantage))
    if 'ref_logprobs' in batch:
      np.testing.assert_array_equal(batch['ref_logprobs'][r, loss], s.ref_logprobs[:c])
    prompt_part = t[:p - 1]
    for key in ('behaviour_logprobs', 'advantages') + (('ref_logprobs',) if 'ref_logprobs' in batch
                                                       else ()):
      assert np.all(batch[key][r, prompt_part] == 0), key
    assert np.all(batch['versions'][r, prompt_part] == -1)

  # Segments: 1..k left to right in each row, each segment is exactly one sample.
  for r in range(rows):
    seg, ix = batch['segment_ids'][r], idx[r]
    real = seg > 0
    starts = np.flatnonzero(real & np.concatenate([[True], seg[1:] != seg[:-1]]))
    np.testing.assert_array_equal(seg[starts], np.arange(1, len(starts) + 1))
    for a, b in zip(starts, list(starts[1:]) + [seq_len]):
      run = ix[a:b][seg[a:b] == seg[a]]
      assert len(set(run)) == 1
  # Padding is inert.
  pad = idx == -1
  np.testing.assert_array_equal(pad, batch['segment_ids'] == 0)
  for key in ('tokens', 'targets', 'positions', 'loss_mask', 'behaviour_logprobs', 'advantages'):
    assert np.all(batch[key][pad] == 0), key
  assert np.all(batch['versions'][pad] == -1)

  num_tokens = sum(min(len(s.prompt_tokens) + len(s.completion_tokens) - 1, seq_len)
                   for s in samples)
  assert batch['loss_mask'].sum() == stats.num_loss_tokens
  assert stats.num_tokens == num_tokens == np.sum(~pad)
  assert stats.num_samples == len(samples)
  assert stats.truncated_tokens == truncated
  assert stats.fill == pytest.approx(num_tokens / (rows * seq_len))


@pytest.mark.parametrize('seed', range(6))
def test_layout_invariants_random(seed):
  rng = np.random.default_rng(seed)
  seq_len = int(rng.integers(24, 64))
  samples = random_samples(rng, int(rng.integers(1, 40)), max_p=12, max_c=seq_len - 10,
                           with_ref=bool(seed % 2))
  batch, stats = packing.pack_samples(samples, seq_len)
  check_layout(samples, batch, stats, seq_len)
  assert stats.num_loss_tokens == sum(len(s.completion_tokens) for s in samples)
  assert stats.truncated_samples == 0
  assert stats.num_rows >= -(-stats.num_tokens // seq_len)
  # Per-token data comes back per sample through unpack_per_token.
  for key, field in (('behaviour_logprobs', 'behaviour_logprobs'), ('versions', 'versions')):
    per_sample = packing.unpack_per_token(batch[key], batch)
    assert len(per_sample) == len(samples)
    for s, got in zip(samples, per_sample):
      np.testing.assert_array_equal(got, getattr(s, field).astype(got.dtype))

  again, again_stats = packing.pack_samples(samples, seq_len)
  assert again_stats == stats
  for key in batch:
    np.testing.assert_array_equal(again[key], batch[key])

  m = int(rng.integers(2, 5))
  rounded, rstats = packing.pack_samples(samples, seq_len, row_multiple=m)
  assert rstats.num_rows % m == 0 and 0 <= rstats.num_rows - stats.num_rows < m
  check_layout(samples, rounded, rstats, seq_len)
  for key in batch:  # the extra rows are appended padding
    np.testing.assert_array_equal(rounded[key][:stats.num_rows], batch[key])


def test_first_fit_decreasing_placement():
  # Positions per sample (P=1): 3, 7, 5, 5, 2, 8 into rows of 10.
  # Longest first: 8->row0, 7->row1, 5(#2)->row2, 5(#3)->row2, 3->row1, 2->row0: three full rows.
  samples = [simple_sample(1, n) for n in (3, 7, 5, 5, 2, 8)]
  batch, stats = packing.pack_samples(samples, 10)
  expected = np.array([[5] * 8 + [4] * 2, [1] * 7 + [0] * 3, [2] * 5 + [3] * 5])
  np.testing.assert_array_equal(batch['sample_index'], expected)
  np.testing.assert_array_equal(batch['segment_ids'][0], [1] * 8 + [2] * 2)
  assert stats.num_rows == 3 and stats.fill == 1.0
  check_layout(samples, batch, stats, 10)
  # Equal lengths keep input order.
  batch, _ = packing.pack_samples([simple_sample(2, 4) for _ in range(6)], 10)
  np.testing.assert_array_equal(batch['sample_index'][:, ::5], [[0, 1], [2, 3], [4, 5]])


def test_loss_positions_of_one_sample():
  s = simple_sample(3, 4)  # tokens 1 2 3 | 100 101 102 103
  batch, stats = packing.pack_samples([s], 8)
  np.testing.assert_array_equal(batch['tokens'][0], [1, 2, 3, 100, 101, 102, 0, 0])
  np.testing.assert_array_equal(batch['targets'][0], [2, 3, 100, 101, 102, 103, 0, 0])
  np.testing.assert_array_equal(batch['loss_mask'][0], [0, 0, 1, 1, 1, 1, 0, 0])
  np.testing.assert_allclose(batch['behaviour_logprobs'][0], [0, 0, -.1, -.2, -.3, -.4, 0, 0])
  np.testing.assert_array_equal(batch['versions'][0], [-1, -1, 0, 1, 2, 3, -1, -1])
  np.testing.assert_array_equal(batch['advantages'][0], [0, 0, .5, .5, .5, .5, 0, 0])
  assert stats.num_tokens == 6 and stats.num_loss_tokens == 4 and stats.fill == 0.75


def test_num_rows_exact_and_too_few():
  samples = [simple_sample(2, 6) for _ in range(5)]  # 7 positions each, one per row of 10
  batch, stats = packing.pack_samples(samples, 10, num_rows=8)
  assert stats.num_rows == 8 and batch['tokens'].shape == (8, 10)
  assert np.all(batch['segment_ids'][5:] == 0)
  check_layout(samples, batch, stats, 10)
  with pytest.raises(ValueError, match=r'need 5 rows.*num_rows=4'):
    packing.pack_samples(samples, 10, num_rows=4)
  with pytest.raises(ValueError, match='row_multiple'):
    packing.pack_samples(samples, 10, num_rows=6, row_multiple=4)


def test_overlong_error_names_sample_and_lengths():
  samples = [simple_sample(2, 3), simple_sample(2, 3), simple_sample(4, 10)]
  with pytest.raises(ValueError, match=r'sample 2 has 14 tokens.*seq_len=8'):
    packing.pack_samples(samples, 8)
  # Exactly seq_len + 1 tokens fits without truncation.
  _, stats = packing.pack_samples([simple_sample(4, 5)], 8)
  assert stats.truncated_samples == 0 and stats.fill == 1.0


def test_overlong_truncate_keeps_prefix_and_counts():
  rng = np.random.default_rng(7)
  samples = [simple_sample(4, 10), simple_sample(2, 3), simple_sample(8, 1), simple_sample(3, 9)]
  batch, stats = packing.pack_samples(samples, 8, overlong='truncate')
  # Sample 0: 13 positions -> 8, loses 5 completion tokens; sample 3: 11 -> 8, loses 3.
  assert stats.truncated_samples == 2 and stats.truncated_tokens == 8
  assert stats.num_loss_tokens == 5 + 3 + 1 + 6
  check_layout(samples, batch, stats, 8)
  got = packing.unpack_per_token(batch['behaviour_logprobs'], batch)
  np.testing.assert_allclose(got[0], -np.arange(1, 6) / 10, rtol=1e-6)
  # Random samples, several of them overlong.
  samples = random_samples(rng, 30, max_p=10, max_c=40)
  batch, stats = packing.pack_samples(samples, 24, overlong='truncate')
  assert stats.truncated_samples == sum(len(s.prompt_tokens) + len(s.completion_tokens) > 25
                                        for s in samples) > 0
  check_layout(samples, batch, stats, 24)


def test_truncate_needs_a_completion_token_in_the_row():
  with pytest.raises(ValueError, match=r'sample 1: prompt of 9 tokens.*seq_len=8'):
    packing.pack_samples([simple_sample(2, 2), simple_sample(9, 2)], 8, overlong='truncate')
  # A prompt of seq_len tokens still leaves one completion target.
  batch, stats = packing.pack_samples([simple_sample(8, 3)], 8, overlong='truncate')
  assert stats.num_loss_tokens == 1 and batch['loss_mask'][0, -1] == 1


def test_ref_logprobs_all_or_none():
  rng = np.random.default_rng(3)
  with_ref = random_samples(rng, 4, 5, 5, with_ref=True)
  without = random_samples(rng, 4, 5, 5)
  assert 'ref_logprobs' in packing.pack_samples(with_ref, 16)[0]
  assert 'ref_logprobs' not in packing.pack_samples(without, 16)[0]
  with pytest.raises(ValueError, match=r'ref_logprobs.*missing for samples \[4, 5, 6, 7\]'):
    packing.pack_samples(with_ref + without, 16)


def test_bad_arguments():
  samples = [simple_sample(2, 2)]
  with pytest.raises(ValueError, match='overlong'):
    packing.pack_samples(samples, 8, overlong='drop')
  with pytest.raises(ValueError, match='seq_len'):
    packing.pack_samples(samples, 0)
  batch, stats = packing.pack_samples([], 8)
  assert stats.num_rows == 0 and stats.fill == 0.0 and batch['tokens'].shape == (0, 8)
  assert packing.unpack_per_token(batch['tokens'], batch) == []


@pytest.mark.parametrize('field, kwargs', [
    ('prompt_tokens', dict(prompt_tokens=[])),
    ('completion_tokens', dict(completion_tokens=[], behaviour_logprobs=[], versions=[])),
    ('prompt_tokens', dict(prompt_tokens=[1.0, 2.0])),
    ('prompt_tokens', dict(prompt_tokens=[[1, 2]])),
    ('completion_tokens', dict(completion_tokens=[5, -1, 6])),
    ('behaviour_logprobs', dict(behaviour_logprobs=[-0.1, -0.2])),
    ('behaviour_logprobs', dict(behaviour_logprobs=[-0.1, np.nan, -0.3])),
    ('versions', dict(versions=[0, 1, 2, 3])),
    ('versions', dict(versions=[0.0, 1.0, 2.0])),
    ('ref_logprobs', dict(ref_logprobs=[-0.1])),
    ('advantage', dict(advantage=float('nan'))),
])
def test_bad_sample_fields(field, kwargs):
  good = dict(prompt_tokens=[1, 2], completion_tokens=[5, 6, 7], behaviour_logprobs=[-.1, -.2, -.3],
              versions=[0, 0, 1], advantage=1.0)
  packing.Sample(**good)  # the baseline is valid
  with pytest.raises(ValueError, match=rf'Sample\.{field}'):
    packing.Sample(**{**good, **kwargs})


def test_split_microbatches():
  rng = np.random.default_rng(5)
  samples = random_samples(rng, 20, 8, 20)
  batch, stats = packing.pack_samples(samples, 32, row_multiple=4)
  micro = packing.split_microbatches(batch, 4)
  r = stats.num_rows // 4
  for key, x in micro.items():
    assert x.shape == (4, r, 32)
    for m in range(4):
      np.testing.assert_array_equal(x[m], batch[key][m * r:(m + 1) * r])
  # unpack_per_token reads the split view too.
  for s, got in zip(samples, packing.unpack_per_token(micro['versions'], micro)):
    np.testing.assert_array_equal(got, s.versions)
  odd, _ = packing.pack_samples(samples[:1], 32, num_rows=3)
  with pytest.raises(ValueError, match='num_micro=2'):
    packing.split_microbatches(odd, 2)


@pytest.mark.parametrize('full_rows', [1, 3, 5, 9, 17])
def test_micro_batch_rows_fix_each_shard_rows_and_let_the_count_follow(full_rows):
  """With micro_batch_rows = 2 on 4 data shards, every micro-batch is [8, T] (2 rows per shard)
  however many rows the batch needs; their number is a power of two."""
  from pipelinerl_jax.pipeline import trainer as trainer_lib
  samples = [packing.Sample(np.arange(1, 9), np.arange(1, 25), np.zeros(24), np.zeros(24, int),
                            advantage=1.0) for _ in range(full_rows)]  # 31 positions: one a row
  multiple = packing.row_multiple(data_parallel=4, micro_batches=1, micro_batch_rows=2)
  batch, stats = packing.pack_samples(samples, 32, row_multiple=multiple)
  rows = trainer_lib.bucket_rows(stats.num_rows, multiple)
  assert rows >= full_rows
  num_micro = packing.num_micro_batches(rows, 4, micro_batches=1, micro_batch_rows=2)
  assert rows == num_micro * 8 and num_micro & (num_micro - 1) == 0
  batch, _ = packing.pack_samples(samples, 32, num_rows=rows, row_multiple=multiple)
  assert packing.split_microbatches(batch, num_micro)['tokens'].shape == (num_micro, 8, 32)
  # Without micro_batch_rows the count is fixed and the rows per micro-batch grow instead.
  assert packing.row_multiple(4, micro_batches=8) == 32
  assert packing.num_micro_batches(64, 4, micro_batches=8) == 8
  with pytest.raises(ValueError, match='not a multiple of micro_batch_rows'):
    packing.num_micro_batches(12, 4, micro_batches=1, micro_batch_rows=2)


def test_packed_logprobs_match_per_sample_forward():
  config = transformer.ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                   qkv_bias=True)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  # Weights 3x the 0.02 init: logits (|z| ~ 4) depend strongly on context, yet stay small
  # enough for fp32 rounding to sit well inside the 1e-5 tolerance.
  params = jax.tree.map(lambda w: w * 3, params)
  rng = np.random.default_rng(11)
  lengths = [(3, 9), (5, 14), (2, 4), (6, 6), (1, 20), (4, 3), (7, 11)]
  samples = [random_sample(rng, p, c) for p, c in lengths]
  seq_len = 32
  batch, stats = packing.pack_samples(samples, seq_len)
  assert stats.num_rows < len(samples)
  assert batch['segment_ids'].max() >= 3  # several rows hold later segments at an offset

  logp_fn = jax.jit(lambda tokens, targets, positions, segments: transformer.token_logprobs(
      params, config, tokens, targets, positions, segments, chunk_size=16)[0])
  packed = np.asarray(logp_fn(batch['tokens'], batch['targets'], batch['positions'],
                              batch['segment_ids']))

  # Reference: each sample alone in its own row from position 0, right-padded (causal
  # attention keeps the padding out of the real positions); one jitted call for all samples.
  alone = np.zeros((len(samples), seq_len + 1), np.int32)
  for i, s in enumerate(samples):
    seq = np.concatenate([s.prompt_tokens, s.completion_tokens])
    alone[i, :len(seq)] = seq
  logits = jax.jit(lambda t: transformer.forward_logits(params, config, t))(alone[:, :-1])
  logp_all = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  max_err = 0.0
  for i, s in enumerate(samples):
    n = len(s.prompt_tokens) + len(s.completion_tokens) - 1
    want = np.take_along_axis(logp_all[i, :n], alone[i, 1:n + 1, None], axis=-1)[:, 0]
    got = packed[batch['sample_index'] == i]  # every position, prompt targets included
    assert got.shape == want.shape
    max_err = max(max_err, float(np.max(np.abs(got - want))))
  assert max_err <= 1e-5, max_err

  # The comparison is sensitive: with one segment per row, attention crosses samples and the
  # later segments' log-probs move far beyond the tolerance.
  one_segment = (batch['segment_ids'] > 0).astype(np.int32)
  leaked = np.asarray(logp_fn(batch['tokens'], batch['targets'], batch['positions'], one_segment))
  later = batch['segment_ids'] > 1
  assert np.max(np.abs(leaked - packed)[later]) > 0.1


def test_segment_spans_describe_each_rows_samples_and_cap_them():
  """The spans a fused kernel reads are the samples' positions; max_segments caps a row's
  samples (packing opens another row) and sets the spans' width."""
  rng = np.random.default_rng(3)
  samples = random_samples(rng, 30, 3, 4)  # short samples: many per row
  batch, stats = packing.pack_samples(samples, 32)
  assert batch['segment_starts'].shape == (stats.num_rows, 32)
  capped, capped_stats = packing.pack_samples(samples, 32, max_segments=3)
  assert batch['segment_ids'].max() > 3 and capped['segment_ids'].max() == 3
  assert capped['segment_starts'].shape == (capped_stats.num_rows, 3)
  assert capped_stats.num_rows > stats.num_rows
  for b, width in ((batch, 32), (capped, 3)):
    starts, lengths = packing.segment_spans(b['segment_ids'], width)
    np.testing.assert_array_equal(b['segment_starts'], starts)
    np.testing.assert_array_equal(b['segment_lengths'], lengths)
    for r, row in enumerate(b['segment_ids']):
      for g in range(width):
        span = slice(starts[r, g], starts[r, g] + lengths[r, g])
        assert (lengths[r, g] == 0) == (g + 1 > row.max())
        assert lengths[r, g] == 0 or (row[span] == g + 1).all() and (row == g + 1).sum() == \
            lengths[r, g]
  with pytest.raises(ValueError, match=r'row \d+ holds \d+ samples, more than max_segments=3'):
    packing.segment_spans(batch['segment_ids'], 3)
  with pytest.raises(ValueError, match='not the contiguous segment'):
    packing.segment_spans(np.array([[1, 1, 2, 1]]), 4)
