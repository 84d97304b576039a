"""A recorded page's comm row: buckets in flight at the same time are drawn on lanes of their own,
so one bar never hides the end of another."""


def test_buckets_in_flight_at_once_get_lanes_of_their_own_in_their_rank_row():
    from ddplab.timeline import BucketRecord, IterationRecord, Timeline
    from ddplab.widgets.gantt import gantt_traces

    tl = Timeline("ddp", 1)
    tl.iterations.append(IterationRecord(0, 0, 0.0, 0.1, {"forward": (0.0, 0.02), "backward": (0.02, 0.08)}))
    for k, (a, e) in enumerate([(0.03, 0.07), (0.05, 0.09), (0.08, 0.095)]):  # 0 and 1 overlap; 2 after 0
        tl.buckets.append(BucketRecord(0, 0, k, 1000, (f"p{k}",), grads_ready=a, launch=a, comm_end=e))
    comm = [t for t in gantt_traces(tl)[0] if t.customdata is not None][0]
    offsets = dict(zip(comm.customdata, comm.offset))
    assert offsets[0] != offsets[1] and offsets[2] == offsets[0]  # a lane is reused once free
    assert set(comm.y) == {"rank 0 comm"} and set(comm.width) == {0.4}
