"""RL on math. Presets: `--config=configs/math.py:<preset>`.

  tiny             the CPU demo (the default): arithmetic on a tiny locally built model
  qwen1p5b_8xh100  Qwen2.5-Math-1.5B on one 8xH100 host, vLLM generation
  paper_7b         the paper's Qwen2.5-7B run (B=1024, G=8, lr 1e-6, 8192 new tokens)

The GPU presets leave the model and the data as placeholders; set them on the command line:
  --config.model.path=/models/Qwen2.5-Math-1.5B \\
  --config.task.train_files="('/data/orz_math_57k.jsonl',)" \\
  --config.task.test_files="('/data/math500.jsonl', '/data/aime24.jsonl')"
(config validation names the missing one). Problems are local .jsonl / .json / .parquet files.

Every field and its meaning is in pipelinerl_jax/config.py:base_config; override any of them on
the command line, e.g. `--config.rl.mode=conventional --config.rl.conventional_steps=4`.
"""

from pipelinerl_jax import config as config_lib

PRESETS = ('tiny', 'qwen1p5b_8xh100', 'paper_7b')


def get_config(arg=None):
  preset = arg or 'tiny'
  if preset not in PRESETS:
    raise ValueError(f'configs/math.py: unknown preset {preset!r} (known: {", ".join(PRESETS)})')
  c = config_lib.base_config()
  if preset == 'tiny':
    # A ~100k-param Qwen2-format model built and SFT-warmed locally on 2-digit addition, then
    # PipelineRL on unseen problems, all on 2 CPU cores. See demo-calibration in the README.
    c.task.name = 'arithmetic'
    c.task.ops = ('+',)
    c.task.digits = 2
    c.generation.num_slots = 128
    c.generation.max_prompt_len = 8
    c.generation.max_new_tokens = 12
    c.rl.batch_size = 128            # 16 prompts x 8 samples per optimizer step
    c.rl.group_size = 8
    c.rl.max_lag = 4
    c.rl.total_steps = 100_000       # the time budget below ends the demo
    c.rl.max_time_s = 600.0
    c.optimizer.lr = 3e-4
    c.optimizer.max_grad_norm = 1.0
    c.train.seq_len = 128
  elif preset == 'qwen1p5b_8xh100':
    _math_task(c)
    _gpu_model(c)
    # 5 GPUs train (FSDP), the 3 the mesh leaves free are for generation: the paper's 80:48
    # split. A local Ray start gets those 3 GPUs only, one per generator actor.
    c.train.mesh = '1,5,1'
    c.generation.backend = 'vllm'
    c.generation.placement = 'ray'
    c.generation.num_generators = 3   # one vLLM actor per free GPU (5, 6, 7)
    c.generation.remote.weight_transport = 'nccl'  # from the trainer's GPU, bucketed
    # Qwen2.5-Math's context is 4096 tokens: prompt + completion must fit in it.
    c.generation.max_prompt_len = 512
    c.generation.max_new_tokens = 3072
    c.generation.num_slots = 768      # H: ~256 sequences per generation GPU keeps decode busy
    c.rl.batch_size = 512             # 64 prompts x 8 samples per step (half the paper's B:
    c.rl.group_size = 8               # one host generates ~16x fewer tokens/s than 48 GPUs)
    # Appendix A: g_max ~ H * L / (mean length * B) = 768 * 3072 / (~700 * 512) ~ 7.
    c.rl.max_lag = 8
    c.rl.total_steps = 1000
    c.optimizer.lr = 1e-6             # the paper's Adam lr, constant
    c.train.seq_len = 8192            # packed rows: 2+ full-length samples each
    c.train.micro_batches = 8         # ~500 samples x ~1k tokens -> ~64 rows, 8 per micro-batch
    c.task.reward.overlong_max_len = 3072  # soft penalty in the last 512 tokens (DAPO-style)
    c.task.reward.overlong_buffer = 512
  elif preset == 'paper_7b':
    # Section 5: Qwen2.5-7B base on Open-Reasoner-Zero problems, 128 H100 (48 generate at
    # H = 64 each, 80 train). Our runs are single-host: the RL settings are the paper's, the
    # placement is one 8-GPU host's, 5 train and 3 generate (set train.mesh and
    # generation.num_generators for yours).
    _math_task(c)
    _gpu_model(c)
    c.train.mesh = '1,5,1'
    c.generation.backend = 'vllm'
    c.generation.placement = 'ray'
    c.generation.num_generators = 3   # more hosts: `ray start` them, set cluster.address='auto'
    c.generation.remote.weight_transport = 'nccl'  # and num_generators to their GPU count
    c.generation.max_prompt_len = 1024
    c.generation.max_new_tokens = 8192
    c.generation.temperature = 1.0
    c.generation.num_slots = 64 * 48  # H = 64 per generation GPU, 48 of them
    c.rl.batch_size = 1024
    c.rl.group_size = 8
    # Not stated as a setting in our notes; Appendix A's bound g_max ~ H*I*L / (mean len * B)
    # = 3072 * 8192 / (~3000 * 1024) ~ 8 is what this pipeline would reach unconstrained.
    c.rl.max_lag = 8
    c.rl.total_steps = 1000
    c.optimizer.lr = 1e-6             # Adam, constant
    c.loss.kind = 'pipelinerl'        # eq. 5: truncated IS REINFORCE
    c.loss.is_cap = 5.0               # c = 5
    c.advantage.baseline = 'mean'     # A = R - group mean, no std normalization
    c.train.seq_len = 16384
    c.train.micro_batches = 64        # ~1024 x ~3k tokens -> ~200 rows of 16k
    c.task.reward.overlong_max_len = 8192  # "a soft penalty near max length"
    c.task.reward.overlong_buffer = 1024
  return c


def _math_task(c):
  """Math with reward 1 if correct else 0; model.path and task.*_files are placeholders."""
  c.task.name = 'math'
  c.model.path = ''                   # REQUIRED: an HF model dir
  c.task.train_files = ()             # REQUIRED: training problems
  c.task.test_files = ()              # for evaluate.py and eval.every_steps
  c.task.verify_workers = 8
  c.task.verify_timeout_s = 5.0
  # In-run evaluation builds a JAX engine on a device vLLM owns here: evaluate saved checkpoints
  # with `python -m pipelinerl_jax.evaluate` instead.
  c.eval.every_steps = 0
  c.eval.num_problems = 0             # whole test sets
  c.eval.k = 8


def _gpu_model(c):
  """bf16 compute with fp32 master weights (Adam at lr 1e-6 would lose updates in bf16), fp32
  lm_head (logprob mismatch with the generator), rematerialized layers for long sequences."""
  c.model.param_dtype = 'float32'
  c.model.dtype = 'bfloat16'
  c.model.lm_head_fp32 = True
  c.model.remat = True
  c.log.progress = True
