"""``megaflow plan``: the model arithmetic against the real models, and the command on the shipped configs.

Needs: CPU; 1 process for the measured part (slow). Checks:
- parameter counts (megaflow.plan.dit) equal the diffusers models' numel exactly (tiny SD3.5-like with dual
  attention and q/k norm, tiny FLUX, tiny Wan with and without its cross-attention norm; SD3's position table is a
  buffer, counted apart);
- predicted saved activations of a forward within 25% of autograd's saved bytes (tiny SD3, FLUX and Wan at sizes
  where activations dominate; also under LoRA, base frozen, adapters on two target sets), and the predicted trainer memory (weights, fp32 grads, Adam, activations) vs the
  peak RSS of building the trainer and one train step: ratio printed, asserted within [0.6, 1.6];
- the plan of both GPU configs (built-in tables) and of a tiny pipeline dir (read from its files);
- LoRA activations by linear implementation, and one optimizer step's GRPO microbatches (exact arithmetic);
- the reward models: a tiny local CLIP's count against the loaded model's numel, the built-in table without the
  directory, the items only on the scoring ranks of a config with a model reward on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.config import load_config
from megaflow.models.flux import tiny as flux_tiny
from megaflow.models.sd3 import tiny as sd3_tiny
from megaflow.models.wan import tiny as wan_tiny
from megaflow.plan.memory import format_plan, plan, trainer_items
from megaflow.plan.dit import (
    LORA_STAGE_EXTRA, STAGE_EXTRA, block_activation_units, dims_from_config, total_params,
)
from megaflow.plan.rewards import MODELS_ITEM, REWARD_MODELS, SCORING_ITEM, reward_load
from megaflow.testing.dist import run_multiprocess

import plan_workers

SD3 = sd3_tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0, 1), num_layers=4, attention_head_dim=16,
                           num_attention_heads=4, caption_projection_dim=64, sample_size=64, pos_embed_max_size=64)
REWARD_ITEMS = {MODELS_ITEM, SCORING_ITEM}
FLUX = flux_tiny.tiny_config(attention_head_dim=16, num_attention_heads=4, axes_dims_rope=(4, 6, 6))
WAN = wan_tiny.tiny_config(attention_head_dim=16, num_attention_heads=4, ffn_dim=160, text_dim=32, num_layers=4)


def test_param_counts_equal_diffusers_models():
    model = sd3_tiny.diffusers_model(SD3)
    n = sum(p.numel() for p in model.parameters())
    assert total_params(dims_from_config("sd3", SD3, "tiny")) == n
    model = flux_tiny.diffusers_model(FLUX)
    assert total_params(dims_from_config("flux", FLUX, "tiny")) == sum(p.numel() for p in model.parameters())
    for conf in (WAN, {**WAN, "cross_attn_norm": False}):  # cross-attention blocks, their own MLP width
        model = wan_tiny.diffusers_model(conf)
        assert total_params(dims_from_config("wan", conf, "tiny")) == sum(p.numel() for p in model.parameters())


def _predicted_saved(family: str, dcfg: dict, image: int, text: int, batch: int, targets=None) -> float:
    d = dims_from_config(family, dcfg, "tiny")
    units = sum(block_activation_units(d, i, image, text, 1, False, targets) for i in range(d.num_blocks))
    return (units + (STAGE_EXTRA if targets is None else LORA_STAGE_EXTRA) * (image + text)) * batch * d.hidden * 4


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_predictions_vs_measured_memory(family, tmp_path):
    if family == "sd3":
        dcfg, batches = SD3, sd3_tiny.sft_batches(SD3, num_microbatches=1, batch=4, context_len=32, latent_size=64)
        image, text = 32 * 32, 32
    elif family == "wan":  # 4 latent frames of 16 x 16 tokens
        dcfg = WAN
        batches = wan_tiny.sft_batches(WAN, num_microbatches=1, batch=4, frames=4, height=32, width=32, context_len=32)
        image, text = 4 * 16 * 16, 32
    else:
        dcfg, batches = FLUX, flux_tiny.sft_batches(FLUX, num_microbatches=1, batch=4, grid=32, context_len=32)
        image, text = 32 * 32, 32
    torch.save(dict(family=family, dcfg=dcfg, batches=batches), tmp_path / "case.pt")
    (m,) = run_multiprocess(plan_workers.measure_rank, 1, str(tmp_path / "case.pt"), timeout_s=600)
    predicted = _predicted_saved(family, dcfg, image, text, batch=4)
    print(family, "saved: predicted", predicted / 2**20, "MiB, measured", m["saved"] / 2**20, "MiB")
    assert 0.75 <= predicted / m["saved"] <= 1.25, (predicted, m)
    cfg = load_config(None, [f"model.family={family}", "algo.kl_beta=0", "train.micro_batch_size=4"])
    items, _ = trainer_items(cfg, dims_from_config(family, dcfg, "tiny"), world=1, stage=0, image=image, text=text)
    trainer = sum(v for k, v in items.items() if k not in ("runtime", "GRPO microbatches (1 step)"))  # one SFT step
    ratio = trainer / m["peak_rss"]
    print(family, f"train step: predicted {trainer / 2**20:.1f} MiB, peak RSS {m['peak_rss'] / 2**20:.1f} MiB, "
          f"ratio {ratio:.2f}")
    assert 0.6 <= ratio <= 1.6, (trainer, m)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("targets", [("linear_qkv", "linear_proj"),
                                     ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")])
def test_lora_predictions_vs_measured_saved_bytes(family, targets, tmp_path):
    """Frozen base: autograd keeps no input of a frozen linear nor the adaLN-only operands, about 0.55-0.75 of
    the full-parameter bytes; the LoRA coefficients must follow the measurement."""
    if family == "sd3":
        dcfg, batches = SD3, sd3_tiny.sft_batches(SD3, num_microbatches=1, batch=4, context_len=32, latent_size=64)
    else:
        dcfg, batches = FLUX, flux_tiny.sft_batches(FLUX, num_microbatches=1, batch=4, grid=32, context_len=32)
    torch.save(dict(family=family, dcfg=dcfg, batches=batches, targets=targets), tmp_path / "case.pt")
    (saved,) = run_multiprocess(plan_workers.measure_saved_rank, 1, str(tmp_path / "case.pt"), timeout_s=600)
    predicted = _predicted_saved(family, dcfg, 32 * 32, 32, batch=4, targets=targets)
    print(family, targets, "saved under LoRA: predicted", predicted / 2**20, "MiB, measured", saved / 2**20, "MiB")
    assert 0.75 <= predicted / saved <= 1.25, (predicted, saved)
    assert predicted < 0.8 * _predicted_saved(family, dcfg, 32 * 32, 32, batch=4)


def test_plan_lora_activations_follow_the_linear_implementation():
    """Under LoRA the frozen linears keep no input at TP=1 and with Transformer Engine (spec auto/te); megatron's
    own linear function (spec local, TP>1) keeps it, so the full-parameter activations stay there."""
    base = ["lora.rank=32", "lora.alpha=64.0", 'lora.targets=["linear_qkv","linear_proj"]', "train.recompute=none"]
    def act(overrides, gpus=8):
        cfg = load_config("configs/sd3_medium_8xh100.toml", overrides)
        return plan(cfg, gpus=gpus, gpu_mem_gib=80)["groups"][0].items["activations"]
    full = act(["train.recompute=none"])
    lora = act(base)
    assert 0.5 < lora / full < 0.7  # flow_grpo's SD3 LoRA targets: about 0.6 of the full-parameter bytes
    assert act(base + ['model.spec="local"']) == pytest.approx(lora)  # TP=1: F.linear either way
    tp2 = base + ["parallel.tp=2"]
    assert act(tp2 + ['model.spec="local"']) == pytest.approx(act(["train.recompute=none", "parallel.tp=2"]))
    assert act(tp2) < 0.7 * act(tp2 + ['model.spec="local"'])


def test_plan_counts_one_optimizer_steps_microbatches():
    """grpo_update puts every micro-batch of an optimizer step on the GPU at once: this DP rank's (sample, step)
    items, x_t twice under CFG plus x_{t+1} in fp32, text conditioning (negative and positive) in bf16."""
    def mb(overrides=()):
        cfg = load_config("configs/sd3_medium_8xh100.toml", list(overrides))
        return plan(cfg, gpus=8, gpu_mem_gib=80)["groups"][0].items["GRPO microbatches (1 step)"]
    items = 16 * 24 * 9 // 8  # prompts x group x int(10 x 0.99) trained steps, over 8 DP ranks
    per_item = 3 * 1024 * 64 * 4 + 2 * (333 * 4096 + 2048) * 2
    assert mb() == items * per_item
    assert mb(["train.num_minibatches=2"]) == items // 2 * per_item
    assert mb(["rollout.sde_window_size=2", "algo.clip_range=1e-5"]) == 16 * 24 * 2 // 8 * per_item
    no_cfg = mb(["rollout.guidance_scale=1.0"])
    assert no_cfg == items * (2 * 1024 * 64 * 4 + (333 * 4096 + 2048) * 2)


def test_plan_gpu_configs_and_a_pipeline_dir(tiny_sd3_dir):
    sd3 = plan(load_config("configs/sd3_medium_8xh100.toml"), gpus=8, gpu_mem_gib=80)
    assert sd3["fits"] and [g.ranks for g in sd3["groups"]] == [list(range(8))]  # an engine on every rank
    assert abs(sd3["params"] - 2.24e9) < 0.01e9 and sd3["image_tokens"] == 1024
    rank0_only = plan(load_config("configs/sd3_medium_8xh100.toml", ['rollout.engine_hosts="rank0"']), gpus=8,
                      gpu_mem_gib=80)
    rank0, others = rank0_only["groups"]
    assert rank0.ranks == [0] and others.ranks == list(range(1, 8))
    # rank 0 hosts the engines and scores (PickScore on its GPU); the others neither
    engines = sum(v for k, v in rank0.items.items() if k.startswith(("engine", "reward")))
    assert REWARD_ITEMS <= set(rank0.items) and not REWARD_ITEMS & set(others.items)
    assert sum(rank0.items.values()) - others.total == pytest.approx(engines) and not others.phases
    assert sd3["groups"][0].total == pytest.approx(rank0.total) == pytest.approx(rank0.phases["rollout"])
    flux = plan(load_config("configs/flux_dev_2x8xh100.toml"), gpus=16, gpu_mem_gib=80)  # LoRA, engine on every rank
    assert abs(flux["params"] - 11.9e9) < 0.05e9 and flux["fits"]
    items = flux["groups"][0].items
    assert "KL reference" not in items and items["grads (fp32 buffer)"] < 0.02 * items["weights"]
    full = plan(load_config("configs/flux_dev_2x8xh100.toml", ["lora.rank=0"]), gpus=16, gpu_mem_gib=80)
    assert not full["fits"] and "KL reference" in full["groups"][0].items  # full-parameter at this layout
    text = format_plan(full)
    assert "DOES NOT FIT" in text and "fits: no" in text and "rollout 101.7 GiB" in text
    assert "reward pickscore: 986.1M params from CLIP ViT-H/14" in text and "reward models" in text
    # disaggregated: a second node of 8 engine GPUs (engine ranks); the trainer GPUs carry no engine, those carry no trainer
    dis = plan(load_config("configs/sd3_medium_8xh100.toml", ['rollout.placement="disaggregated"', 'rollout.engine_hosts="rank0"',
                                                              "rollout.engine_ranks=8", 'bridge.mode="distributed"']),
               gpus=16, gpu_mem_gib=80)
    trainers, engines = dis["groups"]
    assert trainers.ranks == list(range(8)) and engines.ranks == list(range(8, 16)) and dis["fits"]
    assert trainers.total == pytest.approx(others.total)  # the colocated rank without engines
    assert set(engines.items) == {"runtime", *(k for k in rank0.items if k.startswith(("engine", "reward")))}
    tiny = plan(load_config(None, [f"model.pretrained={tiny_sd3_dir}"]), gpus=1, gpu_mem_gib=3)
    assert str(tiny_sd3_dir) in tiny["dims"].source and tiny["fits"]
    with pytest.raises(ValueError, match="does not divide the .* trainer GPU"):
        plan(load_config("configs/flux_dev_2x8xh100.toml"), gpus=6, gpu_mem_gib=80)


@pytest.mark.parametrize("offload", ["none", "optimizer", "all"])
def test_plan_phases_with_trainer_offload(offload):
    """A phased rank (colocated, synchronous) peaks at the larger of its training phase (the trainer's items; the
    engines released, the batch scored) and its rollout phase (the engines' items, the reward's scoring batch and
    what train.offload leaves on the GPU; the reward model stays in both), summed here by hand from the items;
    FLUX.1-dev full-parameter on 2x8 H100 fits with the optimizer offloaded."""
    cfg = load_config("configs/flux_dev_2x8xh100.toml", ["lora.rank=0", f"train.offload={offload}"])
    (group,) = plan(cfg, gpus=16, gpu_mem_gib=80)["groups"]
    items = group.items
    engines = sum(v for k, v in items.items() if k.startswith("engine"))
    rollout_only = engines + items["reward scoring activations"]  # the batch is scored before training
    train = sum(items.values()) - rollout_only
    assert train == pytest.approx(sum(items[k] for k in ("weights", "grads (fp32 buffer)", "optimizer (Adam, /dp)",
                                                         "activations", "GRPO microbatches (1 step)", "KL reference",
                                                         "optimizer step temporaries", "runtime", "reward models")))
    states = items["grads (fp32 buffer)"] + items["optimizer (Adam, /dp)"]
    kept = {"none": train - items["activations"] - items["GRPO microbatches (1 step)"]
            - items["optimizer step temporaries"], "optimizer": items["weights"] + items["KL reference"]
            + items["runtime"] + items["reward models"],
            "all": items["KL reference"] + items["runtime"] + items["reward models"]}[offload]
    if offload == "none":
        assert kept == pytest.approx(items["weights"] + states + items["KL reference"] + items["runtime"]
                                     + items["reward models"])
    assert group.phases == pytest.approx({"train": train, "rollout": kept + rollout_only})
    assert group.total == pytest.approx(max(train, kept + rollout_only))
    assert (group.total <= 80 * 2**30) == (offload != "none")
    # asynchronous: the engines keep their memory while the trainer trains, every item at once
    (ahead,) = plan(load_config("configs/flux_dev_2x8xh100.toml", ["lora.rank=0", "train.max_staleness=1"]), gpus=16,
                    gpu_mem_gib=80)["groups"]
    assert not ahead.phases and ahead.total == pytest.approx(sum(items.values()))


def _tiny_clip_dir(root) -> tuple:
    """A tiny transformers CLIP saved to ``root`` and its parameter count, counted from the loaded model."""
    from transformers import CLIPConfig, CLIPModel
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=77)
    vision = dict(hidden_size=48, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(root)
    loaded = CLIPModel.from_pretrained(root)
    return root, sum(p.numel() for p in loaded.parameters())


def _with_reward(config: str, weights: str, kwargs: str, *extra: str):
    return load_config(config, [f"reward.weights={weights}", f"reward.kwargs={kwargs}", *extra])


def test_plan_reward_models_from_a_local_clip_dir(tmp_path):
    """A local model directory's count (safetensors headers) equals the loaded CLIPModel's numel; its vision config
    sizes the scoring batch; two CLIP rewards on one directory and device share one copy (load_clip)."""
    clip, n = _tiny_clip_dir(tmp_path / "clip")
    load = reward_load("pickscore", {"path": str(clip), "device": "cuda", "batch_size": 2})
    assert load.model == n and load.head == 0 and str(clip) in load.source
    assert load.scoring == 2 * 4 * (17 * 48 * 12 + 4 * 17 * 17)  # (32 / 8)^2 + 1 tokens, width 48, 4 heads
    cfg = _with_reward("configs/sd3_medium_8xh100.toml", "{pickscore=1.0}",
                       f'{{pickscore={{path="{clip}",device="cuda"}}}}')
    (group,) = plan(cfg, gpus=8, gpu_mem_gib=80)["groups"]
    assert group.items[MODELS_ITEM] == n * 4  # float32
    both = _with_reward("configs/sd3_medium_8xh100.toml", "{pickscore=1.0,clipscore=0.0}",
                        f'{{pickscore={{path="{clip}",device="cuda"}},clipscore={{path="{clip}",device="cuda"}}}}')
    assert plan(both, gpus=8, gpu_mem_gib=80)["groups"][0].items[MODELS_ITEM] == n * 4


def test_plan_reward_items_only_where_a_model_reward_is_on_a_gpu():
    """No model reward, or one on the CPU: no reward item (the CPU one is listed as not counted). One on a GPU: on
    the engine hosts, and on rank 0 when it evaluates on test prompts."""
    shapes = ["data.prompts=shapes", "reward.weights={shapeeval_partial=1.0}", "reward.kwargs={}"]
    none = plan(load_config("configs/sd3_medium_8xh100.toml", shapes), gpus=8, gpu_mem_gib=80)
    assert not REWARD_ITEMS & set(none["groups"][0].items) and none["rewards"] == []
    cpu = plan(load_config("configs/sd3_medium_8xh100.toml", ['reward.kwargs={pickscore={path="x"}}']), gpus=8,
               gpu_mem_gib=80)
    assert not REWARD_ITEMS & set(cpu["groups"][0].items) and "on cpu (not on a GPU: not counted)" in cpu["rewards"][0]
    dis = ['rollout.placement="disaggregated"', 'rollout.engine_hosts="rank0"', "rollout.engine_ranks=8",
           'bridge.mode="distributed"']
    trainers, engines = plan(load_config("configs/sd3_medium_8xh100.toml", dis), gpus=16, gpu_mem_gib=80)["groups"]
    assert REWARD_ITEMS <= set(engines.items) and not REWARD_ITEMS & set(trainers.items)
    evaluating = dis + ['data.test_prompts="data/pickscore/test.txt"', "eval.every=10"]
    driver, trainers, engines = plan(load_config("configs/sd3_medium_8xh100.toml", evaluating), gpus=16,
                                     gpu_mem_gib=80)["groups"]
    assert driver.ranks == [0] and REWARD_ITEMS <= set(driver.items) and not REWARD_ITEMS & set(trainers.items)


def test_plan_reward_builtin_table_without_the_directory():
    """Without the local directory the published counts are used: PickScore's ViT-H/14 (~3.7 GiB in float32, a
    16-image scoring batch ~0.3 GiB), and the rows of rewards added elsewhere (hpsv2, imagereward)."""
    pick = reward_load("pickscore", {"path": "models/absent", "device": "cuda"})
    assert pick.model == REWARD_MODELS["pickscore"].params == 986_109_441 and "built-in table" in pick.source
    assert 0.2 < pick.scoring / 2**30 < 0.4
    assert reward_load("hpsv2", {"path": "absent.pt", "device": "cuda"}).model == 986_109_441
    assert reward_load("imagereward", {"path": "absent", "device": "cuda"}).model == 446_206_689
    aesthetic = reward_load("aesthetic", {"clip_path": "absent", "head_path": "absent.pth", "device": "cuda"})
    assert (aesthetic.model, aesthetic.head) == (427_616_513, 927_969)
    flux = plan(load_config("configs/flux_dev_2x8xh100.toml"), gpus=16, gpu_mem_gib=80)
    assert flux["groups"][0].items[MODELS_ITEM] == 986_109_441 * 4


def test_reward_table_counts_equal_the_models():
    """The built-in rows against the models built from the published configs (meta device, no weights): CLIP ViT-L/14
    (openai/clip-vit-large-patch14), ViT-H/14 (PickScore_v1, laion CLIP-ViT-H-14; HPS v2's OpenCLIP ViT-H-14 is the
    same network), ImageReward as megaflow.rewards.imagereward builds it (BLIP ViT-L/16, cross-attention BERT-base
    without pooler, MLP head), the aesthetic MLP."""
    from transformers import (BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel, CLIPConfig,
                              CLIPModel)

    from megaflow.rewards.aesthetic import mlp_from_state

    def numel(*models):
        return sum(p.numel() for m in models for p in m.parameters())

    def clip(text_width, text_layers, width, layers, projection):
        text = dict(hidden_size=text_width, intermediate_size=4 * text_width, num_attention_heads=text_width // 64,
                    num_hidden_layers=text_layers, max_position_embeddings=77, vocab_size=49408)
        vision = dict(hidden_size=width, intermediate_size=4 * width, num_attention_heads=16,
                      num_hidden_layers=layers, image_size=224, patch_size=14)
        return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection))

    widths = [(768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    head = {f"layers.{i}.weight": torch.empty(o, n) for i, (n, o) in zip((0, 2, 4, 6, 7), widths)}
    with torch.device("meta"):
        large, huge = clip(768, 12, 1024, 24, 768), clip(1024, 24, 1280, 32, 1024)
        vit = BlipVisionModel(BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                               num_attention_heads=16, image_size=224, patch_size=16))
        bert = BlipTextModel(BlipTextConfig(vocab_size=30524, hidden_size=768, encoder_hidden_size=1024,
                                            intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                            max_position_embeddings=512, is_decoder=True), add_pooling_layer=False)
        mlp = mlp_from_state(head)
    assert numel(large) == REWARD_MODELS["clipscore"].params == REWARD_MODELS["aesthetic"].params
    assert numel(huge) == REWARD_MODELS["pickscore"].params == REWARD_MODELS["hpsv2"].params
    assert numel(mlp) == REWARD_MODELS["aesthetic"].head
    assert numel(vit, bert, mlp) == REWARD_MODELS["imagereward"].params
