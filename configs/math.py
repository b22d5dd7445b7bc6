"""RL on math. Presets: `--config=configs/math.py:<preset>`.

  tiny             the CPU demo (the default): arithmetic on a tiny locally built model
  tiny_lora        the same with LoRA: rank-8 adapters on every projection, the base frozen
  tiny_moe         the CPU demo's model as a mixture of experts (docs/moe.md)
  tiny_hybrid      the CPU demo's model as a Qwen3.5 hybrid: 3 Gated DeltaNet layers to 1 gated
                   attention layer, served by the JAX engine (docs/models.md)
  tiny_hybrid_moe  the CPU demo's model as a Qwen3.5-MoE: 3 Gated DeltaNet layers to 1 full-
                   attention layer, every MLP 8 experts beside a shared one (docs/moe.md)
  reasoning        the paper's regime on CPU: long worked solutions (~20-150 tokens) that span
                   several weight updates each; 15 minutes of RL on 2 cores (docs/results.md)
  tools            multi-turn: 2-digit products with a calculator tool the warm-started model
                   learns to call (tasks/calculator.py); a few minutes on CPU
  qwen1p5b_8xh100  Qwen2.5-Math-1.5B on one 8xH100 host, vLLM generation
  paper_7b         the paper's Qwen2.5-7B run (B=1024, G=8, lr 1e-6, 8192 new tokens)
  qwen3_1p7b_1xgpu Qwen3-1.7B, full fine-tuning on one GPU of 80 GB or more: the trainer and
                   the JAX engine in one process
  qwen3_8b_lora_1xgpu  Qwen3-8B with LoRA on one 80 GB GPU: trainer and JAX engine share the
                   frozen bf16 base (one copy)
  qwen3_30b_a3b    Qwen3-30B-A3B (a mixture of experts) on 3 hosts of 8 GPUs of 80 GB: two
                   trainer processes on 16 GPUs, 8 vLLM generators
  qwen3_5_2b_1xgpu Qwen3.5-2B (hybrid: Gated DeltaNet and gated attention), full fine-tuning on
                   one 80 GB GPU, trainer and JAX engine in one process (placed by the memory
                   plan)
  qwen3_5_9b_lora_1xgpu  Qwen3.5-9B with LoRA on one 80 GB GPU, trainer and JAX engine sharing
                   the frozen bf16 base (placed by the memory plan)
  eval             what `pipelinerl-eval` uses for an HF model dir or a PEFT adapter dir when no
                   --config is given: math test files, greedy, up to 4096 new tokens

The GPU presets leave the model and the data as placeholders; set them on the command line:
  --config.model.path=/models/Qwen2.5-Math-1.5B \\
  --config.task.train_files="('/data/orz_math_57k.jsonl',)" \\
  --config.task.test_files="('/data/math500.jsonl', '/data/aime24.jsonl')"
(config validation names the missing one). Problems are local .jsonl / .json / .parquet files.

Every field and its meaning is in pipelinerl_jax/config.py:base_config; override any of them on
the command line, e.g. `--config.rl.mode=conventional --config.rl.conventional_steps=4`.
"""

from pipelinerl_jax import config as config_lib


def get_config(arg=None):
  preset = arg or 'tiny'
  if preset not in PRESETS:
    raise ValueError(f'configs/math.py: unknown preset {preset!r} (known: {", ".join(PRESETS)})')
  return PRESETS[preset]()


def tiny():
  """A 145k-param Qwen2-format model built and SFT-warmed locally on 2-digit addition, then
  PipelineRL on unseen problems, all on 2 CPU cores (docs/results.md: the CPU demo)."""
  c = config_lib.base_config()
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
  return c


def tiny_lora():
  """`tiny` with LoRA (docs/lora.md): rank-8 adapters on all seven projections of every layer,
  the base frozen; only the adapters are trained, published and saved. LoRA RL wants about 10x
  the full fine-tuning learning rate at the widths that rule was found at (~4096: LoRA Without
  Regret, Thinking Machines 2025); A's init scale 1/sqrt(I) makes each step move the weights
  8x more at this model's width of 64, so 2e-3 (picked from short probes of 1e-3 to 3e-3;
  docs/lora.md)."""
  c = tiny()
  c.model.lora.rank = 8
  c.model.lora.alpha = 32.0
  c.optimizer.lr = 2e-3
  return c


def tiny_moe():
  """`tiny` with a mixture of experts: the demo model as a Qwen3-MoE, 8 experts of width 32 in
  each of its 2 layers, 4 per token, renormalized gates (as many expert weights as `tiny`'s MLP
  has weights: on a CPU, XLA computes a grouped matmul as a masked product over every expert),
  built and SFT-warmed as `tiny`'s is, on more examples; model.moe_routing picks routing replay
  (docs/moe.md)."""
  c = tiny()
  demo = c.model.demo
  demo.architecture = 'qwen3_moe'
  demo.num_experts, demo.num_experts_per_tok, demo.moe_intermediate_size = 8, 4, 32
  demo.norm_topk_prob = True
  # Experts each see a share of the tokens: on tiny's 1,000 examples the warm start memorizes
  # them before it generalizes. A quarter of the problems (RL draws from the rest) and 2,000
  # examples.
  c.task.sft_pool_mod = 4
  demo.sft_examples = 2000
  # A third of tiny's rate: a first try at tiny's 3e-4 did worse (docs/moe.md).
  c.optimizer.lr = 1e-4
  return c


def tiny_hybrid():
  """`tiny` on a hybrid: the demo model as a Qwen3.5, 4 layers of its width, 3 Gated DeltaNet
  (2 key heads, 4 value heads of 16, a convolution of 4 taps) to 1 gated full-attention layer,
  built and SFT-warmed as `tiny`'s is. The JAX engine keeps KV pages for the attention layer
  and a state per slot for the linear ones (docs/models.md)."""
  c = tiny()
  demo = c.model.demo
  demo.architecture = 'qwen3_5'
  demo.num_layers = 4
  return c


def tiny_hybrid_moe():
  """`tiny_moe` as a Qwen3.5-MoE: 4 layers of width 64, three Gated DeltaNet layers (2 key heads,
  4 value heads of 16) then one gated full-attention layer, each MLP 8 experts of width 32 (4 a
  token, renormalized) beside a shared expert of width 32 with its sigmoid gate; built and
  SFT-warmed as `tiny_moe`'s is; model.moe_routing picks routing replay (docs/moe.md)."""
  c = tiny_moe()
  demo = c.model.demo
  demo.architecture = 'qwen3_5_moe'
  demo.num_layers = 4
  demo.full_attention_interval = 4
  demo.linear_num_key_heads, demo.linear_num_value_heads = 2, 4
  demo.linear_key_head_dim = demo.linear_value_head_dim = 16
  demo.shared_expert_intermediate_size = 32
  return c


def reasoning():
  """Long-hand addition with every carry written out (tasks/reasoning.py): RL on operands of 1-6
  digits, the warm start on 1-8 (it has seen every line shape RL asks for). A 3-layer model
  SFT-warmed locally on 2000 worked solutions. H = 128 slots of ~100-token samples against B = 16
  per step: a sample is decoded across several optimizer steps, on an idle host and a busy one
  alike (docs/results.md: its runs)."""
  c = config_lib.base_config()
  c.task.name = 'reasoning'
  c.task.ops = ('+',)
  c.task.min_digits = 1
  c.task.digits = 6
  c.task.sft_max_digits = 8
  c.task.reward.truncated = 'penalize'
  demo = c.model.demo
  demo.hidden_size, demo.intermediate_size = 64, 256
  demo.num_layers, demo.num_heads, demo.num_kv_heads, demo.head_dim = 3, 2, 2, 32
  demo.max_position_embeddings = 256  # 8-digit SFT examples: prompt 19 + solution 222
  demo.sft_examples = 2000
  demo.batch_size = 64             # at most; as many as first-fit packs into the rows
  demo.rows_per_step = 16          # ~26 solutions of 20-240 tokens per step
  demo.lr = 1e-3
  demo.warmup_steps = 50
  demo.max_steps = 1500            # the SFT budget (the smoke test shrinks it)
  demo.eval_every = 100
  demo.target_sampled_accuracy = 0.5
  c.generation.num_slots = 128
  c.generation.max_prompt_len = 16  # '999999+999999=\n'
  c.generation.max_new_tokens = 151  # the longest 6-digit solution (150) + EOS
  # How many versions write a sample is its decode time over the time between two updates.
  # Both scale with B when generation limits the pace (a sample lives ~H/B steps) and the second
  # with B when training does: a small B keeps samples across updates on fast and slow hosts
  # (at B = 32 it swung with the host's load; bench/regime.py measures it).
  c.rl.batch_size = 16             # 2 prompts x 8 samples per optimizer step
  c.rl.group_size = 8
  c.rl.max_lag = 8
  c.rl.total_steps = 100_000       # the time budget below ends the run
  c.rl.max_time_s = 900.0
  # A near-deterministic policy that must get ~100 tokens exactly right: 3e-4 (the tiny
  # demo's) collapsed it at B = 32, pipeline and conventional alike; 5e-5 at B = 16 is the rate
  # per sample that 1e-4 was at B = 32 (1e-4 at B = 16 collapsed it too, later).
  c.optimizer.lr = 5e-5
  c.optimizer.max_grad_norm = 1.0
  c.train.seq_len = 256
  return c


def tools():
  """Two-digit products (`37*48=`) with a calculator: an episode is up to 3 model turns, a call
  `<calc>37*48</calc>`, the environment's `<res>1776</res>`, then `\\boxed{1776}`. The tiny
  demo model cannot multiply in its head; the warm start teaches the call format on 30% of its
  SFT examples and direct answers (mostly wrong at this size) on the rest, so the policy starts
  calling on about a third of the problems and RL has that share to raise along with the reward
  (docs/results.md: the tools runs)."""
  c = config_lib.base_config()
  c.task.name = 'calculator'
  c.task.ops = ('*',)
  c.task.digits = 2
  c.task.max_turns = 3
  # A call (19 tokens with EOS), its result (up to 15; an error up to ~40) and the answer
  # (13): room for a second call, not for a third.
  c.task.max_episode_tokens = 96
  c.task.sft_tool_share = 0.3
  # Sampled accuracy 0.2 (a call answered right on ~2/3 of the calls, direct answers nearly never)
  # is where the warm start stops: the policy knows the format and RL has most of the way to go.
  c.model.demo.target_sampled_accuracy = 0.2
  c.model.demo.max_steps = 800
  c.generation.num_slots = 128
  c.generation.max_prompt_len = 8
  # Engines hold max_prompt_len + max_new_tokens per sequence and episodes live within that, so
  # a turn's own limit is the episode's budget here (a turn that never stops is cut there).
  c.generation.max_new_tokens = 96
  c.rl.batch_size = 128              # 16 prompts x 8 episodes per optimizer step
  c.rl.group_size = 8
  c.rl.max_lag = 4
  c.rl.total_steps = 100_000         # the time budget below ends the run
  c.rl.max_time_s = 300.0
  c.optimizer.lr = 3e-4
  c.optimizer.max_grad_norm = 1.0
  c.train.seq_len = 128              # prompt + episode: 8 + 96
  return c


def qwen1p5b_8xh100():
  """Qwen2.5-Math-1.5B on one 8xH100 host: 4 GPUs train, 4 generate with vLLM."""
  c = config_lib.base_config()
  _math_task(c)
  _gpu_model(c)
  _gpu_placement(c)
  # Qwen2.5-Math's context is 4096 tokens: prompt + completion must fit in it.
  c.generation.max_prompt_len = 512
  c.generation.max_new_tokens = 3072
  # H = 192 sequences per generation GPU (keeps decode busy) x num_generators: 768 on 4 GPUs;
  # validation derives num_slots, so it follows a --config.generation.num_generators override.
  c.generation.slots_per_generator = 192
  c.generation.num_slots = 0
  c.rl.batch_size = 512             # 64 prompts x 8 samples per step (half the paper's B:
  c.rl.group_size = 8               # one host generates ~16x fewer tokens/s than 48 GPUs)
  # Appendix A: g_max ~ H * L / (mean length * B) = 768 * 3072 / (~700 * 512) ~ 7 on 4 GPUs.
  c.rl.max_lag = 8
  c.rl.total_steps = 1000
  c.optimizer.lr = 1e-6             # the paper's Adam lr, constant
  c.train.seq_len = 8192            # packed rows: 2+ full-length samples each
  # 2 rows of 8k per GPU per micro-batch bound the activations (docs/scaling.md: memory plan);
  # ~500 samples x ~1k tokens -> ~64 rows -> 8 micro-batches.
  c.train.micro_batch_rows = 2
  # Only elementwise work recomputed: the fastest policy measured at 1.5B (memory plan: 40 of
  # 80 GiB per trainer GPU; the 7B's would not fit).
  c.model.remat_policy = 'dots'
  c.task.reward.overlong_max_len = 3072  # soft penalty in the last 512 tokens (DAPO-style)
  c.task.reward.overlong_buffer = 512
  return c


def paper_7b():
  """Section 5: Qwen2.5-7B base on Open-Reasoner-Zero problems, 128 H100 (48 generate at H = 64
  each, 80 train). The RL settings are the paper's, the placement one 8-GPU host's, 4 train and
  4 generate (set train.mesh and generation.num_generators for yours: H follows the latter)."""
  c = config_lib.base_config()
  _math_task(c)
  _gpu_model(c)
  _gpu_placement(c)
  c.generation.max_prompt_len = 1024
  c.generation.max_new_tokens = 8192
  c.generation.temperature = 1.0
  # The paper's H = 64 per generation GPU, x num_generators (validation derives num_slots). (Its
  # 3072 in flight over 48 GPUs would be 768 per GPU here: at ~3k tokens each, 126 GiB of KV
  # cache, more than an 80 GB GPU holds.)
  c.generation.slots_per_generator = 64
  c.generation.num_slots = 0
  c.rl.batch_size = 1024
  c.rl.group_size = 8
  # Not stated as a setting in the paper; Appendix A's bound g_max ~ H*I*L / (mean len * B)
  # is 3072 * 8192 / (~3000 * 1024) ~ 8 on the paper's 48 generation GPUs (256 * 8192 /
  # (~3000 * 1024) ~ 1 on this host's 4): 8 never binds here and keeps the paper's setting.
  c.rl.max_lag = 8
  c.rl.total_steps = 1000
  c.optimizer.lr = 1e-6             # Adam, constant
  c.loss.kind = 'pipelinerl'        # eq. 5: truncated IS REINFORCE
  c.loss.is_cap = 5.0               # c = 5
  c.advantage.baseline = 'mean'     # A = R - group mean, no std normalization
  c.train.seq_len = 16384
  # One 16k row per GPU per micro-batch: params, Adam and gradients leave room for little
  # more (docs/scaling.md: memory plan). ~1024 x ~3k tokens -> ~200 rows -> 64 micro-batches;
  # 1024 full-length samples -> 256.
  c.train.micro_batch_rows = 1
  c.task.reward.overlong_max_len = 8192  # "a soft penalty near max length"
  c.task.reward.overlong_buffer = 1024
  return c


def qwen3_30b_a3b():
  """Qwen3-30B-A3B (a mixture of experts: 30.5B params, 3.3B active a token; configs/models/
  Qwen3-30B-A3B) on math, full fine-tuning with fp32 master weights, on three hosts of 8 GPUs of
  80 GB: the smallest layout the memory plan finds (docs/moe.md). 16 GPUs train as two trainer
  processes, one per host (train.num_processes=2): process 0 is this command on the Ray head
  (`ray start --head --num-gpus=0`, so that no generator takes its GPUs), process 1 a Ray actor
  on another host; rows and experts split 4 x 4 over the 16 (train.mesh 1,4,1,4: fsdp x expert).
  The third host's 8 GPUs generate with vLLM, one each. The run joins the Ray cluster already
  started (cluster.address='auto'); the workdir and checkpoints must be on a filesystem every
  host shares (docs/gpu-kit.md: several hosts).
  Routing is recomputed: routing replay needs the JAX engine's routes, and the JAX engine holds
  the whole model and the next update on one device, 2 x 61 GB in bf16, which no 80 GB GPU
  holds (the memory plan refuses it in one line; on 141 GB GPUs it fits, one host training:
  --config.model.moe_routing=replay --config.generation.backend=jax --config.train.mesh=1,8,1,1
  --config.train.num_processes=1). Not run on GPUs."""
  c = config_lib.base_config()
  _math_task(c)
  _gpu_model(c)
  _gpu_placement(c)
  c.train.mesh = '1,4,1,4'
  # One trainer process sees its own host's 8 GPUs: the 16-device mesh takes two of them.
  c.train.num_processes = 2
  c.cluster.address = 'auto'
  c.generation.num_generators = 8
  # vLLM holds 61 GB of bf16 weights on each 80 GB GPU: an update reaches it one tensor at a
  # time through Ray's object store, where nccl would stage a whole second copy on the GPU.
  c.generation.remote.weight_transport = 'object_store'
  c.generation.max_prompt_len = 512
  c.generation.max_new_tokens = 3072
  c.generation.slots_per_generator = 64
  c.generation.num_slots = 0
  c.rl.batch_size = 512             # 64 prompts x 8 samples per step
  c.rl.group_size = 8
  c.rl.max_lag = 8
  c.rl.total_steps = 1000
  c.optimizer.lr = 1e-6             # Adam, constant
  c.train.seq_len = 8192
  # One 8k row per GPU per micro-batch (memory plan: what is left beside params, Adam and
  # gradients of 30.5B params over 16 GPUs).
  c.train.micro_batch_rows = 1
  c.task.reward.overlong_max_len = 3072
  c.task.reward.overlong_buffer = 512
  return c


def qwen3_1p7b_1xgpu():
  """Qwen3-1.7B (or -1.7B-Base), full fine-tuning on one GPU: the trainer and the JAX engine in
  one process on the same device, the engine decoding between the trainer's steps and taking
  each new policy between two token steps. Placed by the memory plan on an 80 GB and a 141 GB
  card (docs/scaling.md: one GPU)."""
  c = config_lib.base_config()
  _math_task(c)
  _gpu_model(c)
  c.train.mesh = '1,1,1'
  c.generation.backend = 'jax'      # placement 'inline' (the default): this process, device 0
  # The paged cache read by cuDNN: the fastest decode measured on an H100 (docs/results.md).
  c.generation.decode_attention = 'cudnn'
  # Qwen3's thinking traces run to many thousands of tokens, far past this budget: its template
  # is asked for a direct answer (an empty think block). A template without the switch is
  # refused; set --config.task.chat_template_kwargs="{}" for such a model.
  c.task.chat_template_kwargs = {'enable_thinking': False}
  c.generation.max_prompt_len = 512
  c.generation.max_new_tokens = 3072
  c.generation.num_slots = 128      # H
  # 12 GiB of pages: 112k positions, 31 sequences at full length, all 128 at ~880 tokens; a
  # sequence that finds no page waits (or is preempted) rather than the device running out.
  # The memory plan puts the device at 64 GiB in all, room for its estimate to run ~15 % low
  # on an 80 GB card; a 141 GB card takes a larger pool (docs/scaling.md: one GPU).
  c.generation.kv_pool_mb = 12 * 1024
  c.rl.batch_size = 128             # 16 prompts x 8 samples per step
  c.rl.group_size = 8
  c.rl.max_lag = 4
  c.rl.total_steps = 1000
  c.optimizer.lr = 1e-6
  c.train.seq_len = 8192            # packed rows: 2+ full-length samples each
  c.train.micro_batch_rows = 1      # one 8k row at a time bounds the activations
  c.model.remat_policy = 'dots'     # only elementwise work recomputed
  c.task.reward.overlong_max_len = 3072
  c.task.reward.overlong_buffer = 512
  # Evaluated during the run on task.test_files, between two train steps, by a JAX engine of its
  # own on the same device: 12 GiB of KV pool beside the trainer's resident state (its step's
  # gradients and activations are free then) and the run's engine; the memory plan counts it.
  c.eval.every_steps = 50
  c.eval.k = 4
  c.eval.kv_pool_mb = 12 * 1024
  return c


def qwen3_8b_lora_1xgpu():
  """Qwen3-8B with LoRA on ONE 80 GB GPU (docs/lora.md): rank-32 adapters on all seven
  projections of every layer, the base frozen in bf16. The trainer and an inline JAX engine
  share the GPU and the base's one copy (16 GB): the engine reads the trainer's own buffers and
  applies the adapters unmerged at every token step, so an update between two token steps moves
  the adapters alone (~175 MB in bf16, ~350 MB as trained in fp32) on the same device.
  `python -m pipelinerl_jax.memory_plan --config=configs/math.py:qwen3_8b_lora_1xgpu
  --model_config=configs/models/Qwen3-8B --devices=1 --device_gib=80` places it."""
  c = config_lib.base_config()
  _math_task(c)
  _gpu_model(c)
  c.model.lora.rank = 32
  c.model.lora.alpha = 32.0        # alpha fixed, 1/r scaling: the best lr barely moves with r
  # ~10x the full fine-tuning lr (1e-6 in the paper's runs), the rule LoRA RL follows
  # (LoRA Without Regret, Thinking Machines 2025; TRL's reproduction: 1e-5 against 1e-6).
  c.optimizer.lr = 1e-5
  c.train.mesh = '1,1,1'           # the one GPU
  c.task.chat_template_kwargs = {'enable_thinking': False}  # as qwen3_1p7b_1xgpu's
  c.generation.backend = 'jax'
  c.generation.placement = 'inline'
  c.generation.decode_attention = 'xla'
  c.generation.num_slots = 64
  c.generation.max_prompt_len = 1024
  c.generation.max_new_tokens = 4096
  # The paged KV pool, shared by the 64 sequences (a full-length one takes 0.70 GiB); a
  # sequence that cannot grow is preempted and loaded again later.
  c.generation.kv_pool_mb = 36 << 10
  c.rl.batch_size = 64             # 8 prompts x 8 samples per step
  c.rl.group_size = 8
  c.rl.max_lag = 4
  c.rl.total_steps = 1000
  c.train.seq_len = 8192
  c.train.micro_batch_rows = 1
  c.task.reward.overlong_max_len = 4096
  c.task.reward.overlong_buffer = 512
  # Evaluated during the run, as qwen3_1p7b_1xgpu is: the evaluation's engine reads the same
  # base and adds the adapters and a 6 GiB KV pool (the run's pool takes most of the device).
  c.eval.every_steps = 50
  c.eval.k = 4
  c.eval.kv_pool_mb = 6 * 1024
  return c


def eval_():
  """`pipelinerl-eval --checkpoint=DIR --test_files=...` on an HF model dir (an export, a model
  from the Hub) or a PEFT adapter dir: greedy decoding (one sample per problem) up to 4096 new
  tokens; the CLI's flags set the sampling (docs/data.md: evaluation as papers report it) and
  size the prompts to the longest test prompt. No training data: only test files are read."""
  c = config_lib.base_config()
  c.task.name = 'math'
  c.task.verify_workers = 4
  c.generation.max_new_tokens = 4096
  c.generation.max_prompt_len = 1024
  c.train.seq_len = 1024 + 4096
  c.eval.num_problems = 0             # whole test sets
  c.eval.k = 1
  c.eval.temperature = 0.0
  return c


def qwen3_5_2b_1xgpu():
  """Qwen3.5-2B, full fine-tuning on one 80 GB GPU: qwen3_1p7b_1xgpu's run (the trainer and the
  JAX engine in one process) on a hybrid model. model.path takes the Hub's dir
  (Qwen3_5ForConditionalGeneration: the language model is trained, the vision tower carried over
  unchanged on export) or a Qwen3_5ForCausalLM dir. 18 of its 24 layers are Gated DeltaNet:
  KV pages only for the 6 full-attention layers (12 KiB a position in bf16), so the engine's
  default pool, every slot at full length (5.3 GiB), replaces 1.7B's 12 GiB; and per slot a
  fixed state in each linear layer, and as many saved ones (shared prompts' states). The memory
  plan places it: `python -m pipelinerl_jax.memory_plan --config=configs/math.py:qwen3_5_2b_1xgpu
  --model_config=configs/models/Qwen3.5-2B --devices=1 --device=h100`. Run end to end on CPU on
  a miniature of its model (`python -m pipelinerl_jax.bench.gpu --quick
  --sections=qwen3_5_1xgpu`); not run on GPUs."""
  c = qwen3_1p7b_1xgpu()
  c.generation.kv_pool_mb = 0
  return c


def qwen3_5_9b_lora_1xgpu():
  """Qwen3.5-9B with LoRA on ONE 80 GB GPU: qwen3_8b_lora_1xgpu's run (rank-32 adapters on every
  projection LoRA covers, the base frozen in bf16 and shared by the trainer and an inline JAX
  engine) on a hybrid, with twice the sequences in flight. 24 of its 32 layers are Gated
  DeltaNet: KV pages only for the 8 full-attention layers (32 KiB a position in bf16, against
  Qwen3-8B's 144), so the engine's default pool holds all 128 slots at full length (20 GiB),
  beside each slot's fixed state in the 24 linear layers (49 MiB). The memory plan places it:
  `python -m pipelinerl_jax.memory_plan --config=configs/math.py:qwen3_5_9b_lora_1xgpu
  --model_config=configs/models/Qwen3.5-9B --devices=1 --device=h100`. Not run on GPUs."""
  c = qwen3_8b_lora_1xgpu()
  c.generation.num_slots = 128
  c.generation.kv_pool_mb = 0      # every slot at full length
  c.rl.batch_size = 128            # 16 prompts x 8 samples per step
  return c


def _math_task(c):
  """Math with reward 1 if correct else 0; model.path and task.*_files are placeholders."""
  c.task.name = 'math'
  c.model.path = ''                   # REQUIRED: an HF model dir
  c.task.train_files = ()             # REQUIRED: training problems
  c.task.test_files = ()              # for evaluate.py and eval.every_steps
  c.task.verify_workers = 8
  c.task.verify_timeout_s = 5.0
  c.eval.num_problems = 0             # whole test sets
  c.eval.k = 8


def _gpu_placement(c):
  """One 8-GPU host: 4 GPUs train (FSDP), the 4 the mesh leaves free generate, one vLLM Ray actor
  each, weights broadcast from the trainer's GPU over NCCL in buckets. More hosts: `ray start`
  them, set cluster.address='auto' and num_generators to their GPU count.

  Appendix A splits N accelerators into I for generation and N - I for training, with
  throughput min(U(H) * I, (N - I) / tau): the paper's run used 48 of 128 (37.5%) to generate.
  On 8 GPUs that is 3:5, but an fsdp axis of 5 divides neither model width (1536 = 2^9 * 3,
  3584 = 2^9 * 7) nor either vocabulary (151936 = 2^7 * 1187, 152064), so the embeddings and
  attention (for 7B every matrix) would sit whole, with their Adam state, on every trainer GPU;
  6 fails the same way for 7B. 4:4 is the nearest split that shards everything; it leans towards
  generation, which Appendix A's model favours when decoding long completions dominates a step.
  `python -m pipelinerl_jax.memory_plan` checks a layout (docs/scaling.md: memory plan). This
  placement (vLLM on CUDA, Ray actors on GPUs, NCCL) has not run on GPUs yet: README, status on
  GPUs.
  """
  c.train.mesh = '1,4,1'
  c.generation.backend = 'vllm'
  c.generation.placement = 'ray'
  # The in-run evaluation builds a JAX engine on the first device the mesh leaves free, which a
  # vLLM generator owns here (the memory plan refuses it): evaluate saved checkpoints with
  # `pipelinerl-eval` instead.
  c.eval.every_steps = 0
  c.generation.num_generators = 4   # GPUs 4, 5, 6, 7
  # Updates in bf16 (vLLM's serving dtype) from the trainer's GPU 0, one staging buffer each.
  # Unproven: NCCL updates have not run on GPUs yet (the CPU tests run their protocol over gloo);
  # --config.generation.remote.weight_transport=object_store is the transport that has run end
  # to end (on CPU).
  c.generation.remote.weight_transport = 'nccl'
  # Each generator GPU 90% used once vLLM started: CUDA context, staging buffer, weights,
  # activations, CUDA graphs (on), and the KV cache from what is left (generation/budget.py).
  c.generation.vllm.gpu_memory_utilization = 0.9


def _gpu_model(c):
  """bf16 compute with fp32 master weights (Adam at lr 1e-6 would lose updates in bf16), a bf16
  lm_head with fp32 accumulation (log pi moves by 3-7e-3 nats on average against an fp32 head,
  inside the 1e-2 budget: docs/dev/attention-2026-11-26.md), rematerialized layers for
  long sequences. The run refuses to start where JAX has no GPU (--config.allow_cpu=True to
  debug on a CPU, with --config.model.attention=blockwise)."""
  c.platform = 'gpu'
  c.model.param_dtype = 'float32'
  c.model.dtype = 'bfloat16'
  c.model.lm_head_fp32 = False
  # cuDNN's fused attention over the packed rows (Hopper or later; grouped-query heads need JAX
  # >= 0.11, the GPU stack's): the fastest train step measured on an H100 (docs/results.md).
  # The config check refuses it where the installed stack cannot run it (stack.py).
  c.model.attention = 'cudnn'
  c.model.remat = True
  c.log.progress = True


# What each preset is laid out for: `runs_on` in words; for the GPU presets also the model config
# it was planned with (configs/models/), and the devices and card (accelerators.py) the memory
# plan places it on; for the others, `about` its model. `python -m pipelinerl_jax.sim.presets` prints the README's preset table
# from this, with each GPU preset's plan and predicted speed.
HARDWARE = {
    'tiny': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'tiny_lora': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'tiny_moe': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'tiny_hybrid': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'tiny_hybrid_moe': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'reasoning': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'tools': dict(runs_on='a CPU (2 cores)', about='built on first use'),
    'qwen3_1p7b_1xgpu': dict(runs_on='one GPU of 80 GB', model='Qwen3-1.7B', devices=1,
                             card='h100'),
    'qwen3_8b_lora_1xgpu': dict(runs_on='one GPU of 80 GB', model='Qwen3-8B', devices=1,
                                card='h100'),
    'qwen1p5b_8xh100': dict(runs_on='one host of 8 GPUs of 80 GB', model='Qwen2.5-Math-1.5B',
                            devices=8, card='h100'),
    'paper_7b': dict(runs_on='one host of 8 GPUs of 80 GB', model='Qwen2.5-7B', devices=8,
                     card='h100'),
    'qwen3_30b_a3b': dict(runs_on='3 hosts of 8 GPUs of 80 GB', model='Qwen3-30B-A3B',
                          devices=24, card='h100'),
    'qwen3_5_2b_1xgpu': dict(runs_on='one GPU of 80 GB', model='Qwen3.5-2B', devices=1,
                             card='h100'),
    'qwen3_5_2b_1xgpu': dict(runs_on='one GPU of 80 GB',
                             model='Qwen3.5-2B', devices=1, card='h100'),
    'qwen3_5_9b_lora_1xgpu': dict(runs_on='one GPU of 80 GB',
                                  model='Qwen3.5-9B', devices=1, card='h100'),
    'eval': dict(runs_on='where the model fits (evaluation only)', about='the one evaluated'),
}

PRESETS = {'tiny': tiny, 'tiny_lora': tiny_lora, 'tiny_moe': tiny_moe,
           'tiny_hybrid': tiny_hybrid, 'tiny_hybrid_moe': tiny_hybrid_moe,
           'reasoning': reasoning,
           'tools': tools, 'qwen1p5b_8xh100': qwen1p5b_8xh100, 'paper_7b': paper_7b,
           'qwen3_1p7b_1xgpu': qwen3_1p7b_1xgpu, 'qwen3_8b_lora_1xgpu': qwen3_8b_lora_1xgpu,
           'qwen3_30b_a3b': qwen3_30b_a3b, 'qwen3_5_2b_1xgpu': qwen3_5_2b_1xgpu,
           'qwen3_5_9b_lora_1xgpu': qwen3_5_9b_lora_1xgpu, 'eval': eval_}
