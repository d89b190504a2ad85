"""Video rewards from image rewards (megaflow.rewards.frames, ``reward.frames``): clips [B, F, 3, H, W] scored by a
built-in image reward frame by frame equal the mean (first frame, chosen frame) of that reward's own scores of each
frame as images (exact: the same images, the same reward); a frame's failure masks its clip; "video" hands whole
clips to a reward that takes video and is refused for one that scores images; image batches pass unchanged.
Needs: CPU, 1 process (~2 s)."""
from __future__ import annotations

import pytest
import torch

from megaflow.config.video_check import FRAME_WORDS
from megaflow.rewards.frames import FRAME_MODES, FrameReward
from megaflow.rewards.registry import build_multi_reward, build_reward


def _clips(b: int = 3, f: int = 4) -> torch.Tensor:
    return torch.rand(b, f, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def test_frame_words_match_the_config_check():
    assert FRAME_MODES == FRAME_WORDS


@pytest.mark.parametrize("frames", ["mean", "first", "2"])
def test_an_image_reward_scores_clips_frame_by_frame(frames):
    clips, prompts = _clips(), ["a", "b", "c"]
    reward = build_reward("jpeg_compressibility")
    per_frame = torch.stack([reward(clips[:, f], prompts) for f in range(clips.shape[1])], dim=1)  # [B, F]
    want = {"mean": per_frame.mean(dim=1), "first": per_frame[:, 0], "2": per_frame[:, 2]}[frames]
    scores = build_multi_reward({"jpeg_compressibility": 1.0}, frames=frames).score(clips, prompts)
    assert torch.equal(scores.total, want) and torch.equal(scores.components["jpeg_compressibility"], want)


def test_a_failed_frame_masks_its_clip():
    def only_bright(images, prompts, metadata):
        if (images.mean(dim=(1, 2, 3)) < 0.05).any():
            raise ValueError("a dark frame")
        return images.mean(dim=(1, 2, 3))

    clips = _clips()
    clips[1, 3] = 0.0  # one dark frame in clip 1
    reward = FrameReward(only_bright, "mean", label="bright")
    from megaflow.rewards.base import score_with_info
    scores, _ = score_with_info(reward, clips, ["a", "b", "c"], name="bright")
    assert torch.isnan(scores[1]) and torch.isfinite(scores[[0, 2]]).all()
    torch.testing.assert_close(scores[0], clips[0].mean(), rtol=1e-6, atol=0)


def test_video_mode_hands_whole_clips_and_refuses_image_rewards():
    seen = []

    def clip_reward(videos, prompts, metadata):
        seen.append(tuple(videos.shape))
        return videos.flatten(1).mean(dim=1)

    clip_reward.takes_video = True
    clips = _clips()
    out = FrameReward(clip_reward, "video", label="clip")(clips, ["a", "b", "c"])
    assert seen == [(3, 4, 3, 16, 16)] and torch.equal(out, clips.flatten(1).mean(dim=1))
    with pytest.raises(ValueError, match="reward 'jpeg_compressibility' scores images, not video"):
        build_multi_reward({"jpeg_compressibility": 1.0}, frames="video")


def test_image_batches_and_bad_indices():
    images = _clips()[:, 0]
    reward = build_reward("jpeg_compressibility")
    assert torch.equal(FrameReward(reward, 7, label="j")(images, ["a", "b", "c"]), reward(images, ["a", "b", "c"]))
    with pytest.raises(ValueError, match="the clips have 4 frames"):
        FrameReward(reward, 7, label="j")(_clips(), ["a", "b", "c"])
    with pytest.raises(ValueError, match="reward.frames = 'last'"):
        build_multi_reward({"jpeg_compressibility": 1.0}, frames="last")
