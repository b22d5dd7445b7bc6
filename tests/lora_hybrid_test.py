"""LoRA on Qwen3.5 hybrids: adapters on full attention's, the Gated DeltaNet layers' and the MLPs'
projections, stacked run by run of layers; B = 0 is the base and the unmerged delta is the merged
model (so every run's adapters are used); a PEFT export (text and composite layouts) loads in peft
with the merged export's logits and PEFT's own tensor names; the checkpoint restores exactly;
the memory plan counts the adapters of each kind of layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import export as export_lib
from pipelinerl_jax import memory_plan
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models import transformer as tfm
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib

from lora_test import _lora_config, random_adapters  # tests/ is on sys.path
from memory_plan_test import ROOT
from qwen35_test import HYBRID, TOKENS_BxT, checkpoint, hf_logits, hybrid_params  # noqa: F401
import train_test  # its tiny dense CONFIG

LORA = config_lib.LoraSettings(rank=2, alpha=4.0)
EVERY = config_lib.LoraSettings(rank=2, alpha=4.0, targets=config_lib.LORA_TARGETS)


def test_adapters_cover_each_runs_projections_and_b_zero_is_the_base():
  """HYBRID's layers run linear, linear | full | linear: each run gets the adapters of its own
  mixer and its MLP (the gated q_proj twice as wide as the heads), in_proj_b / in_proj_a only
  when asked; B = 0 is bit for bit the base, a random B the merged model; a list of full
  attention's targets alone leaves the linear runs unadapted."""
  shapes = lora_lib.shapes(HYBRID, LORA)
  runs = {path[0]: set() for path in shapes}
  for path in shapes:
    runs[path[0]].add('/'.join(path[1:3]))
  linear = {'linear_attn/in_proj_qkv', 'linear_attn/in_proj_z', 'linear_attn/out_proj',
            'mlp/gate_proj', 'mlp/up_proj', 'mlp/down_proj'}
  full = {'attn/q_proj', 'attn/k_proj', 'attn/v_proj', 'attn/o_proj',
          'mlp/gate_proj', 'mlp/up_proj', 'mlp/down_proj'}
  assert runs == {'layers_0': linear, 'layers_1': full, 'layers_2': linear}
  # Cc = 2 Hk Dk + Hv Dv = 2 * 2 * 8 + 4 * 8; q_proj: 4 heads of 16, and as many gates.
  assert shapes['layers_0', 'linear_attn', 'in_proj_qkv', 'b'] == (2, 2, 64)
  assert shapes['layers_2', 'linear_attn', 'out_proj', 'a'] == (1, 32, 2)
  assert shapes['layers_1', 'attn', 'q_proj', 'b'] == (1, 2, 128)
  every = lora_lib.shapes(HYBRID, EVERY)
  assert set(every) - set(shapes) == {(run, 'linear_attn', p, w) for run in ('layers_0', 'layers_2')
                                      for p in ('in_proj_b', 'in_proj_a') for w in 'ab'}
  assert every['layers_0', 'linear_attn', 'in_proj_a', 'b'] == (2, 2, 4)  # one per value head

  params = hybrid_params()
  tokens = jnp.asarray(TOKENS_BxT[:, :13] % HYBRID.vocab_size)
  logits = jax.jit(tfm.forward_logits, static_argnums=1)
  base = np.asarray(logits(params, HYBRID, tokens))
  fresh = lora_lib.init_adapters(HYBRID, EVERY, jax.random.PRNGKey(1))
  np.testing.assert_array_equal(
      np.asarray(logits(lora_lib.Adapted(params, fresh, EVERY.scale), HYBRID, tokens)), base)
  adapters = random_adapters(HYBRID, EVERY, 2, b_scale=0.3)
  unmerged = np.asarray(logits(lora_lib.Adapted(params, adapters, EVERY.scale), HYBRID, tokens))
  merged = np.asarray(logits(lora_lib.merge(params, adapters, scale=EVERY.scale), HYBRID, tokens))
  assert np.abs(unmerged - base).max() > 0.1
  np.testing.assert_allclose(unmerged, merged, atol=1e-5)
  attention_only = config_lib.LoraSettings(rank=2, alpha=4.0, targets=('q_proj', 'o_proj'))
  adapters = random_adapters(HYBRID, attention_only, 3, b_scale=0.3)
  assert set(adapters) == {'layers_1'}
  unmerged = np.asarray(logits(lora_lib.Adapted(params, adapters, 2.0), HYBRID, tokens))
  assert np.abs(unmerged - base).max() > 0.1
  np.testing.assert_allclose(
      unmerged, np.asarray(logits(lora_lib.merge(params, adapters, scale=2.0), HYBRID, tokens)),
      atol=1e-5)


def test_a_dense_model_adapts_the_targets_it_has_and_a_list_of_none_is_refused():
  """The default list names the Gated DeltaNet's projections too: a dense model skips them and
  gets the adapters it got from its seven (the same leaves, the same random A); a list that
  names nothing the model has is refused in one line."""
  seven = config_lib.LoraSettings(rank=2, alpha=4.0, targets=(
      'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'))
  default = config_lib.LoraSettings(rank=2, alpha=4.0)
  assert lora_lib.targets_in(train_test.CONFIG, default) == seven.targets
  jax.tree.map(np.testing.assert_array_equal,
               lora_lib.init_adapters(train_test.CONFIG, default, jax.random.PRNGKey(4)),
               lora_lib.init_adapters(train_test.CONFIG, seven, jax.random.PRNGKey(4)))
  with pytest.raises(ValueError, match=r'^config.model.lora.targets: in_proj_qkv, out_proj name '
                                       r'no projection of Qwen2ForCausalLM \(it has q_proj, '):
    lora_lib.specs(train_test.CONFIG, config_lib.LoraSettings(
        rank=2, alpha=4.0, targets=('in_proj_qkv', 'out_proj')))


@pytest.mark.parametrize('name,lora', [('text_tied_conv2', EVERY), ('composite_conv3', LORA)],
                         ids=['text-every-target', 'composite-default-targets'])
def test_a_hybrids_peft_export_loads_in_peft_with_the_merged_exports_logits(
    checkpoint, tmp_path, name, lora):
  """A LoRA checkpoint of a hybrid exported both ways: PEFT's PeftModel on the base (the text
  model, or the composite with its vision tower) and transformers on the merged export give the
  same fp32 logits, which the trainer's unmerged adapters give too; the adapter dir's tensors
  are the ones PEFT itself names (under model.language_model. in the composite); the checkpoint
  restores bit for bit."""
  import peft  # (the test extra's: pyproject.toml)
  import torch
  import transformers
  model_dir, _ = checkpoint(name)
  model_config = hf_schema.load_config(model_dir)
  config = _lora_config()
  config.model.lora.rank, config.model.lora.alpha = lora.rank, lora.alpha
  config.model.lora.targets = lora.targets
  config = config_lib.validate(config)
  optimizer = train.make_optimizer(config.optimizer)
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  adapters = random_adapters(model_config, lora, 7, b_scale=0.3)
  state, _ = train.create_sharded_state(adapters, optimizer, mesh)
  state = state.replace(step=jnp.asarray(3, jnp.int32))  # (step 0 is never saved: the model)
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), keep=1, every_steps=0)
  checkpoints.save(state, checkpoint_lib.run_meta(config, str(model_dir), dict(step=3)))
  checkpoints.close()
  target, _ = checkpoint_lib.abstract_state(model_config, optimizer, mesh, lora)
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), 1, 0)
  restored, meta = checkpoints.restore(target)
  checkpoints.close()
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # adapters and Adam state
  checkpoint_lib.check_same_trainable(meta, config, 'ckpt', model_config)

  export_lib.export_hf(tmp_path / 'ckpt', None, tmp_path / 'peft', format='peft')
  export_lib.export_hf(tmp_path / 'ckpt', None, tmp_path / 'merged')
  auto = (transformers.AutoModelForImageTextToText if 'composite' in name
          else transformers.AutoModelForCausalLM)
  base = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
  plain = hf_logits(base, TOKENS_BxT)
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / 'peft')).eval()
  header, _ = hf_files.read_safetensors_header(tmp_path / 'peft' / hf_peft.WEIGHTS_FILE)
  names = set(header) - {'__metadata__'}
  assert names == set(peft.get_peft_model_state_dict(adapted)), 'PEFT names them otherwise'
  prefix = 'model.language_model.' if 'composite' in name else 'model.'
  first = model_config.linear_layers[0]
  assert f'base_model.model.{prefix}layers.{first}.linear_attn.in_proj_qkv.lora_A.weight' in names
  merged = auto.from_pretrained(tmp_path / 'merged', dtype=torch.float32).eval()
  peft_logits, merged_logits = hf_logits(adapted, TOKENS_BxT), hf_logits(merged, TOKENS_BxT)
  assert np.abs(merged_logits - plain).max() > 0.1  # the adapters matter
  # (fp32: the delta unmerged and merged round apart by a few 1e-5 through the layers.)
  np.testing.assert_allclose(peft_logits, merged_logits, atol=1e-4)
  ours = tfm.forward_logits(
      lora_lib.Adapted(hf_checkpoint.load_params(model_dir, model_config), adapters, lora.scale),
      model_config, jnp.asarray(TOKENS_BxT))
  np.testing.assert_allclose(np.asarray(ours), merged_logits, atol=1e-4)


def test_a_checkpoint_resumes_under_a_list_naming_the_same_projections_only():
  """The targets a checkpoint's run trained are compared as the model has them: a list written
  before the Gated DeltaNet's names existed resumes on a dense model under today's default; on
  a hybrid, asking for in_proj_b / in_proj_a too is another set of adapters, refused in one
  line."""
  def meta(targets):
    c = _lora_config()
    c.model.lora.rank, c.model.lora.alpha, c.model.lora.targets = 2, 4.0, targets
    return checkpoint_lib.run_meta(config_lib.validate(c), '.', {})
  config = _lora_config()
  config.model.lora.rank, config.model.lora.alpha = 2, 4.0
  config = config_lib.validate(config)
  seven = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
  checkpoint_lib.check_same_trainable(meta(seven), config, 'ckpt', train_test.CONFIG)
  checkpoint_lib.check_same_trainable(meta(config_lib.LORA_DEFAULT_TARGETS), config, 'ckpt',
                                      HYBRID)
  with pytest.raises(ValueError, match=r'^config.model.lora: this run is LoRA rank 2 alpha 4 on '
                                       r'q_proj,.*,out_proj,gate_proj,up_proj,down_proj, the '
                                       r'checkpoints in ckpt are LoRA rank 2 alpha 4 on .*'
                                       r'in_proj_b,in_proj_a,out_proj'):
    checkpoint_lib.check_same_trainable(meta(config_lib.LORA_TARGETS), config, 'ckpt', HYBRID)


def test_the_memory_plan_counts_a_hybrids_adapters_by_kind_of_layer():
  """Qwen3.5-9B (24 Gated DeltaNet layers, 8 gated attention layers) with rank-32 adapters: the
  trainer's adapters are each layer's projections' inputs and outputs times the rank, and the
  x A saved for the backward pass grows with the 200 adapted projections."""
  nine, source = memory_plan.read_hf_config(ROOT / 'configs/models/Qwen3.5-9B')

  def plan(rank):
    config = config_lib.load_preset('qwen3_5_2b_1xgpu')
    config.model.lora.rank, config.model.lora.alpha = rank, 2.0 * rank
    return memory_plan.plan(config, nine, num_devices=1, device_gib=80, source=source)
  p32, p64 = plan(32), plan(64)
  # Per unit of rank (D 4096, F 12288): a linear layer's in_proj_qkv (D in, 2 * 16 * 128 +
  # 32 * 128 out), in_proj_z (D, 32 * 128) and out_proj (32 * 128, D); an attention layer's
  # q_proj (D, 2 * 16 * 256: queries and gates), k_proj and v_proj (D, 4 * 256), o_proj
  # (16 * 256, D); every layer's MLP (3 of D + F).
  d, f = 4096, 12288
  linear = (d + 8192) + (d + 4096) + (4096 + d)
  attention = (d + 8192) + 2 * (d + 1024) + (4096 + d)
  per_rank = 24 * linear + 8 * attention + 32 * 3 * (d + f)
  assert p32.trainer['adapters'] == 4 * 32 * per_rank  # fp32
  assert p64.trainer['adapters'] == 2 * p32.trainer['adapters']
  tokens = p32.facts['tokens_per_micro_batch']
  assert p64.trainer['saved'] - p32.trainer['saved'] == (24 * 6 + 8 * 7) * tokens * 32 * 2
