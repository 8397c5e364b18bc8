from __future__ import annotations

from workers.engine.runner.model_runner import split_by_patches


def test_split_is_balanced_largest_first_and_covers_every_item_once() -> None:
    patches = [100, 900, 400, 400, 50, 600]
    shares = split_by_patches(patches, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(patches)))
    loads = [sum(patches[i] for i in share) for share in shares]
    assert loads == [1300, 1150]  # 900 -> r0, 600 -> r1, 400 -> r1, 400 -> r0, 100 -> r1, 50 -> r1
    assert all(share == sorted(share) for share in shares)


def test_single_rank_gets_everything_and_extra_ranks_may_be_idle() -> None:
    assert split_by_patches([3, 1, 2], 1) == [[0, 1, 2]]
    assert split_by_patches([5], 3) == [[0], [], []]
