"""A short soak (bench.soak) with random aborts, client disconnects and worker kills."""

from bench.soak import soak


def test_short_soak_loses_nothing_and_leaks_nothing() -> None:
    fig = soak(seconds=12, seed=7)
    assert fig.requests > 100 and fig.worker_kills >= 2 and fig.disconnected > 0
    assert fig.aborted_by_rpc > 0 and fig.completed > 0
    assert fig.lost == 0 and fig.finished_twice == 0 and fig.wrong_tokens == 0
    assert fig.leaked_blocks == 0 and fig.left_running_or_waiting == 0
