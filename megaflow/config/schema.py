"""megaflow's typed configuration tree: one kw-only dataclass per component, no runtime objects as fields; every
field has a one-line ``help`` and its range or choices, enforced by :mod:`megaflow.config.load`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megaflow.config.algo_schema import AlgoConfig
from megaflow.config.fields import MAX_FRAMES, MAX_ITERS, MAX_SIDE, MAX_STEPS, SEED_MAX, opt
from megaflow.families import DEFAULT_FAMILY, family_names

__all__ = ["AlgoConfig", "MAX_ITERS", "MAX_SIDE", "MAX_STEPS", "MegaflowConfig", "SEED_MAX", "opt"]


@dataclass(kw_only=True)
class RunConfig:
    name: str = opt("megaflow", "Run name; the run directory is <output_dir>/<name>.")
    output_dir: str = opt("runs", "Parent directory for run directories (resolved config, checkpoints, metrics).")
    seed: int = opt(1234, "Global seed (model init, noise, prompt order).", ge=0, le=SEED_MAX)
    device: str = opt("auto", "Compute device of the trainer and the engines: auto (cuda if present, else cpu), cpu "
                      "(CUDA hidden from the run, even on a GPU machine) or cuda (error without a device). Applied "
                      "by the megaflow commands (train, demo, pretrain, bench learn).",
                      choices=("auto", "cpu", "cuda"))
    num_threads: int = opt(1, "torch intra-op threads of the trainer processes (1 is fastest on small shared CPUs "
                           "when several processes compute at once).", ge=1, le=1024)


@dataclass(kw_only=True)
class ModelConfig:
    family: str = opt(DEFAULT_FAMILY, "Model family from the registry (megaflow.families); left out, the family of "
                      "model.pretrained's transformer (its config.json's _class_name), else sd3.",
                      choices=family_names())
    pretrained: str = opt("", "Diffusers pipeline directory (with transformer/, vae/, ...); empty = build tiny.")
    spec: str = opt("auto", "Layer implementation: auto (TE on GPU, local on CPU), local, te, or a dotted path "
                    "'pkg.mod:fn' returning a layer spec or a whole model.")
    dtype: str = opt("float32", "Parameter dtype of the trained model.", choices=("float32", "bfloat16"))
    trust_remote_code: bool = opt(False, "Run the code a model directory names (model.pretrained, "
                                  "pretrain.init_from: a config's auto_map, a custom class of model_index.json; "
                                  "the SGLang engines still refuse a custom class); false: such a directory is "
                                  "refused. --trust-remote-code sets it.")


@dataclass(kw_only=True)
class LoRAConfig:
    """LoRA training of the DiT (megaflow.models.common.lora)."""

    rank: int = opt(0, "LoRA rank r; 0 = full-parameter training (every weight trains, a frozen second model "
                    "is the KL reference). r > 0: every DiT weight is frozen and rank-r adapters on the targeted "
                    "linears of both streams train; the KL reference is the same model with the adapters off, "
                    "and the weight sync moves only the adapters (SGLang merges them into its base).", ge=0, le=4096)
    alpha: float = opt(64.0, "LoRA alpha: the adapter's output is scaled by alpha / rank.", gt=0.0)
    targets: list = opt(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                        "Adapted linears, in both streams: linear_qkv (q, k, v), linear_proj (attention output), "
                        "linear_fc1 / linear_fc2 (MLP).", items=str)
    init: str = opt("", "Start from this LoRA adapter (a diffusers/PEFT LoRA safetensors file, or a directory "
                    "with pytorch_lora_weights.safetensors, as `megaflow export` or "
                    "pipeline.save_lora_weights write) instead of A random, B = 0; its rank and alpha must "
                    "equal lora.rank and lora.alpha. Empty = fresh adapters.")


@dataclass(kw_only=True)
class DataConfig:
    prompts: str = opt("shapes", "Prompt source: 'shapes' (ShapeEval train prompts), a text file (one prompt a line), "
                       "a .jsonl file (one object a line: 'prompt' plus fields the rewards get as metadata), a "
                       ".parquet file or a Hugging Face datasets directory (Dataset.save_to_disk; one split, e.g. "
                       ".../train): a string column 'prompt', the other columns metadata; at most 2000 characters "
                       "a prompt and 64 MiB a text file.")
    shapes_categories: list = opt([], "ShapeEval categories to draw from (empty = all).", items=str)
    test_prompts: str = opt("", "Held-out prompts for `megaflow train`'s evaluation (eval.every): a text, .jsonl "
                            "or .parquet file or a datasets directory, read and checked like data.prompts; its "
                            "first eval.num prompts are sampled. Empty = none.")


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = opt(1, "Tensor-parallel degree.", ge=1, le=1024)
    pp: int = opt(1, "Pipeline-parallel degree.", ge=1, le=1024)
    cp: int = opt(1, "Context-parallel degree.", ge=1, le=1024)
    sp: bool = opt(False, "Sequence parallelism (requires tp > 1).")
    vpp: int = opt(0, "Virtual pipeline stages per rank (0 = off; requires pp > 1).", ge=0, le=64)
    gpus: int = opt(0, "Processes (one per GPU) of the launch this layout is for, engine-only ranks included: "
                    "tp * pp * cp divides the trainer ranks among them, the rest is data parallelism. `megaflow "
                    "plan` plans this many GPUs, and megaflow train / demo / pretrain refuse a launch of another size "
                    "(WORLD_SIZE). "
                    "0 = any launch (plan: WORLD_SIZE if set, else tp * pp * cp plus rollout.engine_ranks).",
                    ge=0, le=100_000)
    timeout_s: float = opt(1800.0, "Timeout in seconds of every collective: the default process group "
                           "(init_process_group) and the rollout and weight-sync groups megaflow creates. Ranks "
                           "waiting for other hosts' rollouts wait on the gloo rollout group under it, so it must "
                           "exceed the longest rollout; engine-only ranks (rollout.placement = disaggregated) wait "
                           "for the driver's next command under it, so it must also exceed a training step plus a "
                           "checkpoint write.", gt=0.0)


@dataclass(kw_only=True)
class RolloutConfig:
    num_engines: int = opt(1, "SGLang diffusion engines per engine host (rollout.engine_hosts), run as "
                           "data-parallel replicas.", ge=1, le=64)
    placement: str = opt("colocated", "Where engines run. colocated: every launched rank trains and "
                         "rollout.engine_hosts picks which trainer ranks also host engines (sharing their GPU). "
                         "disaggregated: the last rollout.engine_ranks launched ranks only sample and score (each "
                         "hosts rollout.num_engines engines on its own GPU); the others train and are megatron's "
                         "whole world; weights reach them with bridge.mode = 'distributed'.",
                         choices=("colocated", "disaggregated"))
    engine_ranks: int = opt(0, "With placement = disaggregated: how many launched ranks (the last ones, e.g. "
                            "the whole last node) only sample; must leave at least one trainer rank. 0 with "
                            "colocated.", ge=0, le=4096)
    engine_hosts: str = opt("rank0", "With placement = colocated: which ranks start engines, each pinned to the "
                            "rank's local GPU (on CPU nothing is pinned): rank0 (global rank 0 only), node (local "
                            "rank 0 of every node) or rank (every rank). With either placement, prompt groups are "
                            "split over the hosts (seeded, group-atomic, fewest samples per engine first); each "
                            "host samples and scores its share and every rank receives every trajectory and "
                            "reward as tensors.", choices=("rank0", "node", "rank"))
    group_size: int = opt(4, "Samples per prompt (the GRPO group); one request per group.", ge=2, le=1024)
    prompts_per_iter: int = opt(4, "Prompt groups sampled per training iteration.", ge=1, le=4096)
    num_steps: int = opt(10, "Denoising steps per rollout.", ge=1, le=MAX_STEPS)
    height: int = opt(64, "Image height in pixels.", ge=8, le=MAX_SIDE)
    width: int = opt(64, "Image width in pixels.", ge=8, le=MAX_SIDE)
    num_frames: int = opt(0, "Frames of every video rollout (a video family, e.g. wan: its VAE takes 4k+1 frames, "
                          "e.g. 81); 0: images (an image family).", ge=0, le=MAX_FRAMES)
    fps: int = opt(16, "Frames per second of the video rollouts (the requests, their trajectories, the sample "
                   "files); unused for images.", ge=1, le=240)
    guidance_scale: float = opt(1.0, "Guidance scale of every rollout request. SD3: classifier-free guidance, "
                                "on when > 1.0 (two DiT branches). FLUX.1: the embedded guidance the DiT takes "
                                "as an input (models with guidance_embeds), never CFG.", ge=1.0)
    sde_type: str = opt("sde", "Rollout transition: sde, cps or ode.", choices=("sde", "cps", "ode"))
    noise_level: float = opt(0.7, "SDE/CPS noise level a (0.7 SDE, 0.8 CPS in flow_grpo).", ge=0.0, le=1.0)
    sde_window: list = opt([], "Step indices sampled with SDE (others ODE); empty = all steps.", items=int)
    sde_window_size: int = opt(0, "FlowGRPO-Fast: > 0 draws a fresh window of this many consecutive SDE steps every "
                               "iteration (seeded by run.seed and the iteration; start uniform in sde_window_range); "
                               "the engine samples SDE only there, ODE elsewhere, and only window steps are trained. "
                               "0 = off. Excludes sde_window.", ge=0, le=MAX_STEPS)
    sde_window_range: list = opt([], "FlowGRPO-Fast: [lo, hi], the window lies inside steps lo .. hi-1 "
                                 "(0 <= lo < hi <= num_steps); empty = [0, num_steps].", items=int)
    log_prob_no_const: bool = opt(False, "Use -mean((x'-mu)^2) log-probs (required with CPS).")
    max_sequence_length: int = opt(0, "Prompt length in tokens for every text encoder (SGLang pads each to it); "
                                   "0 = what the pipeline declares in its megaflow.json, else the engine default.",
                                   ge=0, le=4096)
    max_batch_outputs: int = opt(16, "Engine batching: most samples merged into one denoising call (a group "
                                 "larger than this still runs whole).", ge=1, le=4096)
    precision: str = opt("fp32", "Engine precision for DiT, VAE and text encoders (fp32 on CPU).",
                         choices=("fp32", "bf16", "fp16"))
    attention_backend: str = opt("auto", "SGLang's attention backend in the engine (its server argument "
                                 "attention_backend); auto: SGLang's choice (FlashAttention on CUDA in bf16/fp16 "
                                 "with sglang[diffusion], torch SDPA otherwise).",
                                 choices=("auto", "torch_sdpa", "fa", "fa2", "torch_cudnn_sdpa", "sage_attn"))
    engine_threads: int = opt(0, "torch intra-op threads of each engine worker process; 0: run.num_threads. The "
                              "synchronous loop (train.max_staleness = 0) runs one at a time, so the engines and "
                              "the trainer may each use every core; the asynchronous one runs both at once: split "
                              "the cores between run.num_threads and this.", ge=0, le=1024)


@dataclass(kw_only=True)
class RewardConfig:
    weights: dict = opt({"jpeg_compressibility": 1.0}, "Reward name (registry or 'pkg.mod:fn') -> weight.")
    kwargs: dict = opt({}, "Reward name -> constructor arguments, e.g. {color_target = {target = \"red\"}}.")
    num_workers: int = opt(1, "Threads of the async reward scorer.", ge=1, le=256)
    frames: str = opt("mean", "How a video is scored: mean (every frame through the image rewards, the mean over "
                      "frames), first (the first frame), a frame index (e.g. \"8\"), or video (whole clips "
                      "[B, F, 3, H, W], for rewards that take video: a 'pkg.mod:fn' reward with takes_video = True). "
                      "Unused for images.")
    timeout_s: float = opt(600.0, "Seconds one reward may take to score one batch (its per-sample retries "
                           "included); a reward still running then is masked for that batch, like one that "
                           "raised, and counted in reward/<label>_timeouts. Its call cannot be stopped: it is "
                           "left running on a daemon thread and later batches do not wait for it. 0 = no limit.",
                           ge=0.0, le=86400.0)


@dataclass(kw_only=True)
class TrainConfig:
    iterations: int = opt(10, "RL iterations (rollout -> reward -> train -> sync).", ge=1, le=MAX_ITERS)
    lr: float = opt(3e-4, "AdamW learning rate.", gt=0.0)
    weight_decay: float = opt(1e-4, "AdamW weight decay.", ge=0.0)
    grad_clip: float = opt(1.0, "Global grad-norm clip (0 = off).", ge=0.0)
    micro_batch_size: int = opt(4, "Samples per micro-batch in the trainer.", ge=1, le=4096)
    num_inner_epochs: int = opt(1, "Passes over each rollout batch (flow_grpo train.num_inner_epochs); kept samples "
                                "are reshuffled each pass (seeded by run.seed and the iteration).", ge=1, le=1000)
    num_minibatches: int = opt(1, "Optimizer steps per pass: kept samples are split into this many minibatches "
                               "(near-equal sizes), one optimizer step each; the PPO ratio always compares with the "
                               "sampling policy, so from the second step on the clip acts on a stale policy.",
                               ge=1, le=4096)
    max_staleness: int = opt(0, "0: the synchronous loop (sample, train on it, push the weights). 1: the engines "
                             "sample the next iteration's batch while the trainer trains on this one; the new weights "
                             "are pushed once that batch is in, between batches, so every batch after the first "
                             "was sampled by the policy one update older than the trainer's (rollout/staleness); "
                             "FlowGRPO's ratio compares with the sampling policy's log-probs (algo.mismatch can "
                             "correct), NFT's theta_old is one blend newer than the one that sampled. The engines "
                             "keep their memory during training (no release on GPU). Checkpoints hold "
                             "the batch collected ahead, so a resumed run equals the uninterrupted one.",
                             ge=0, le=1)
    offload: str = opt("none", "What the trainer moves to host memory while the engines sample, and back before it "
                       "trains (rollout.placement = 'colocated' with max_staleness = 0 only). optimizer: the optimizer "
                       "states (Adam moments, mixed-precision fp32 main params) and the DDP grad buffers; all: also "
                       "the model weights, after each weight sync.", choices=("none", "optimizer", "all"))
    warmup_iterations: int = opt(0, "Linear learning-rate warm-up over the first N iterations (a fresh Adam's first "
                                 "steps are its largest relative to the gradient's signal).", ge=0, le=MAX_ITERS)
    lr_schedule: str = opt("constant", "Learning rate after the warm-up: constant, or cosine (down to 0 at the last "
                           "iteration).", choices=("constant", "cosine"))
    ema_decay: float = opt(0.0, "EMA of the trained weights, blended after every optimizer step with decay "
                           "min(ema_decay, (1 + n) / (10 + n)) (n = steps so far, this one included); evaluation "
                           "(megaflow demo's after) and megaflow export use it. It lives in checkpoints. 0 = off.",
                           ge=0.0, lt=1.0)
    save_every: int = opt(0, "Checkpoint (model, optimizer, RNGs, prompt position, metrics) every N iterations, "
                          "into <run dir>/checkpoints; 0 = only at the end. The last iteration is always saved.",
                          ge=0, le=MAX_ITERS)
    max_masked_iterations: int = opt(3, "Stop the run (one line naming the reward(s) and why; exit non-zero; the "
                                     "iteration checkpointed) after this many iterations in a row in which the "
                                     "rewards masked every sample (a reward raised, timed out or returned a "
                                     "non-finite score), so nothing trained, or at the end when every iteration "
                                     "was one; 0 = never stop.", ge=0, le=MAX_ITERS)
    keep_checkpoints: int = opt(2, "Newest checkpoints kept; older ones are deleted once a new one is complete.",
                                ge=1, le=1000)
    recompute: str = opt("none", "Activation recompute of the megatron DiT blocks (train, pretrain): none (each block's internal "
                         "activations are kept for backward) or full (a block keeps only its inputs in the forward "
                         "and runs its forward again during backward, through megatron's tensor_parallel.checkpoint: "
                         "one more block forward per trained microbatch, activation memory of a block down to its "
                         "inputs). Embeddings and the final layer are never recomputed; no-grad passes (reference "
                         "model, old log-probs) are unaffected.", choices=("none", "full"))
    recompute_num_layers: int = opt(0, "With recompute = full: 0 = every block; N > 0 = only the first N blocks of each "
                                    "pipeline chunk (megatron's 'block' method), the others keep their activations.",
                                    ge=0, le=1000)


@dataclass(kw_only=True)
class BridgeConfig:
    mode: str = opt("shared_memory", "Weight transfer path to the engines: shared_memory (every engine host hands "
                    "the weights it gathered itself to its own engines through shared memory, CUDA IPC on GPU), "
                    "distributed (global rank 0 broadcasts buckets to the engine hosts over a dedicated group: gloo "
                    "on CPU, NCCL with device tensors on GPU) or disk (safetensors files + reload; engine_hosts = "
                    "rank0 only). The old spelling 'colocated' is read as shared_memory, with a note.",
                    choices=("shared_memory", "distributed", "disk"))
    bucket_mb: float = opt(64.0, "Bucket size for streamed weight updates, MiB.", gt=0.0)
    verify: bool = opt(True, "Verify every sync: each tensor is hashed (bridge.checksum) once while streaming "
                       "and once by every engine afterwards; a mismatch or a missing tensor stops the run. false = "
                       "no check and no hashing (an engine that skips an unknown name then goes unnoticed).")
    checksum: str = opt("xxh3", "Digest of each tensor's dtype, shape and raw bytes that bridge.verify computes, "
                        "the same on the trainer's side and in every engine: xxh3 (xxHash XXH3 128-bit, "
                        "non-cryptographic, near memory speed: catches corrupted, partial or stale weights) or "
                        "sha256 (SHA-256, a cryptographic digest, several times slower). Weights on a GPU are digested "
                        "on the device instead (position-weighted sums modulo a prime, 16 bytes a tensor to the "
                        "host). Checkpoint manifests (MANIFEST.json) are written with the same checksum.",
                        choices=("xxh3", "sha256"))


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: bool = opt(False, "Log to Weights & Biases what metrics.jsonl holds (every row's numbers, step = "
                      "iteration), the eval.every / demo evaluations' eval/* figures at their iteration (0 = "
                      "before training), and the first 16 images of each sample grid ('samples') and of each "
                      "evaluation ('eval/images'), captioned with prompt and reward. wandb picks online or "
                      "offline itself: WANDB_MODE if set, else online after 'wandb login' or with WANDB_API_KEY "
                      "(neither: refused in one line before the run starts); files go under <run dir>/wandb. "
                      "--resume continues the same W&B run (its id is kept in <run dir>/wandb_id).")
    tensorboard: bool = opt(False, "Write the same as logging.wandb (numbers as float32 scalars; the images of "
                            "one call as one grid '<tag>', its numbered captions in the text '<tag>/captions') to "
                            "TensorBoard event files in <run dir>/tensorboard (torch.utils.tensorboard; needs the tensorboard "
                            "package). --resume hides what an earlier session logged after the checkpoint.")
    project: str = opt("megaflow", "W&B project of the run (logging.wandb).")
    entity: str = opt("", "W&B entity (team or user) of the run; empty = wandb's default entity.")
    tags: list = opt([], "W&B tags of the run, e.g. [\"sd3\", \"nft\"].", items=str)
    log_every: int = opt(1, "Print a one-line summary and redraw <run dir>/curves.png every N iterations "
                         "(and at the last).", ge=1, le=MAX_ITERS)
    sample_every: int = opt(10, "Save a grid of the iteration's samples (one group per row, each captioned with "
                            "its prompt and reward) to "
                            "<run dir>/samples/iterNNNNN.png every N iterations and at the last; 0 = off.",
                            ge=0, le=MAX_ITERS)


@dataclass(kw_only=True)
class EvalConfig:
    """ShapeEval of the model before and after training (``megaflow demo``); ``megaflow train``'s evaluation."""

    every: int = opt(0, "megaflow train: evaluate before training (not when resuming), every N iterations and "
                     "after the last, on the EMA when train.ema_decay > 0: the first eval.num data.test_prompts "
                     "(eval.samples_per_prompt ODE samples each, eval.seed, eval.num_steps) scored by the run's "
                     "rewards and broken down by eval.group_by, or, with "
                     "data.prompts = 'shapes' and no test_prompts, ShapeEval's held-out prompts (eval.num, "
                     "eval.num_seen); figures appended to <run dir>/eval.jsonl, a captioned grid saved to "
                     "<run dir>/eval/iterNNNNN.png (a video run: .mp4; before = 00000, after = the last iteration; eval.jsonl's "
                     "'when' is before, iteration or after, its 'iteration' the number). 0 = off.", ge=0, le=MAX_ITERS)
    num: int = opt(300, "Held-out prompts (balanced over the held-out categories), one fixed-seed sample each; "
                   "with data.test_prompts (megaflow train's eval.every): its first eval.num prompts.",
                   ge=1, le=100_000)
    num_seen: int = opt(60, "Prompts of the categories too small to split, reported apart as seen.", ge=0, le=100_000)
    num_train: int = opt(300, "TRAIN prompts of the held-out categories, one fixed-seed sample each (how the model "
                         "does on prompts it trains on, beside the held-out number); 0 = skip.", ge=0, le=100_000)
    seed: int = opt(0, "Seed of the prompt set and of every sample's noise.", ge=0, le=SEED_MAX)
    num_steps: int = opt(0, "Deterministic (ODE) sampling steps; 0 = rollout.num_steps.", ge=0, le=MAX_STEPS)
    samples_per_prompt: int = opt(1, "megaflow train's evaluation on data.test_prompts: samples of each prompt "
                                  "(seeds fixed per prompt and sample; the first is the one a single sample "
                                  "draws); every figure is the mean over all of them.", ge=1, le=1024)
    group_by: list = opt([], "megaflow train's evaluation on data.test_prompts: metadata fields of the test "
                         "prompts (.jsonl keys, table columns) to break the figures down by: for each field and "
                         "each of its values, eval/<field>/<value> = the mean total reward of the samples whose "
                         "prompt has that value (prompts without the field are left out of it).", items=str)


@dataclass(kw_only=True)
class PretrainConfig:
    """``megaflow pretrain``: supervised rectified flow on ground-truth ShapeEval renders of TRAIN prompts."""

    init_from: str = opt("", "Continue from this ShapeEval pipeline dir (its text encoders, VAE and DiT weights; the "
                         "text/VAE phases are skipped and the DiT size fields are taken from it); empty = from scratch.")
    resolution: int = opt(32, "Image (or clip frame) side in pixels (latents: resolution / the family's VAE factor).",
                          choices=(32, 64))
    num_layers: int = opt(5, "DiT blocks (model.family's transformer).", ge=1, le=256)
    num_heads: int = opt(4, "DiT attention heads.", ge=1, le=256)
    head_dim: int = opt(32, "DiT attention head width (hidden = num_heads * head_dim).", ge=8, le=1024)
    text_steps: int = opt(300, "Optimizer steps of the text encoders' scene-parsing objective (megaflow.pretrain.text).",
                          ge=0, le=MAX_ITERS)
    vae_steps: int = opt(500, "Optimizer steps of the VAE autoencoder training.", ge=1, le=MAX_ITERS)
    num_images: int = opt(40000, "Ground-truth renders pre-encoded once (the training pool).", ge=64, le=1_000_000)
    batch_size: int = opt(64, "Images per optimizer step (global, split over data-parallel ranks).", ge=1, le=65536)
    lr: float = opt(1e-3, "AdamW learning rate (linear warm-up, then constant).", gt=0.0)
    warmup_steps: int = opt(200, "Linear learning-rate warm-up steps.", ge=0, le=MAX_ITERS)
    lr_schedule: str = opt("constant", "Learning rate after the warm-up: constant, or cosine (from lr down to 0 at "
                           "max_steps, so set max_steps to the planned length).", choices=("constant", "cosine"))
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0.0)
    ema_decay: float = opt(0.999, "EMA of the weights; evaluation and the saved pipeline use the EMA.", ge=0.0, lt=1.0)
    prompt_dropout: float = opt(0.1, "Share of images trained with the empty prompt (enables CFG).", ge=0.0, lt=1.0)
    minutes: float = opt(60.0, "Wall-clock budget of the DiT phase (stops at minutes or max_steps).", gt=0.0)
    max_steps: int = opt(1_000_000, "Most DiT optimizer steps.", ge=1, le=MAX_ITERS)
    eval_every: int = opt(500, "Evaluate on held-out prompts and save the pipeline every N steps.", ge=1, le=MAX_ITERS)
    eval_prompts: int = opt(100, "Held-out prompts sampled per evaluation (balanced over held-out categories).",
                            ge=1, le=100_000)
    sample_steps: int = opt(10, "Deterministic (ODE) sampling steps in evaluations.", ge=1, le=MAX_STEPS)


@dataclass(kw_only=True)
class MegaflowConfig:
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Run-wide settings."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Model family and weights."})
    lora: LoRAConfig = field(default_factory=LoRAConfig, metadata={"help": "LoRA adapters (rank 0 = off)."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Prompts."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "Trainer parallelism."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "SGLang rollout engines."})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"help": "The RL algorithm and its objective."})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"help": "Rewards."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Optimisation."})
    bridge: BridgeConfig = field(default_factory=BridgeConfig, metadata={"help": "Weight-update bridge."})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Metrics."})
    pretrain: PretrainConfig = field(default_factory=PretrainConfig, metadata={"help": "megaflow pretrain."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "ShapeEval before/after (megaflow demo)."})

    @property
    def phased(self) -> bool:
        """The engine hosts switch between a rollout and a training phase: the engines sample alone, then the
        trainer trains alone. That takes engines on trainer ranks (rollout.placement = 'colocated', whatever
        bridge.mode moves the weights) and a synchronous loop (train.max_staleness = 0). On GPU the engines release
        their memory for training, and ``train.offload`` moves the trainer's parts off the device for the rollout."""
        return self.rollout.placement == "colocated" and self.train.max_staleness == 0
