"""The alpha-beta fit recovers known parameters; predictions follow the bucket order rule."""
import pytest

import ddplab
from ddplab.netsim import LinkModel
from ddplab.netsim.costmodel import fit, measure_allreduce, predict_step


def test_fit_recovers_a_known_link():
    link = LinkModel(bandwidth_gbps=8.0, latency_us=30.0)
    sizes = [2**k for k in range(10, 24, 2)]
    f = fit(sizes, [link.allreduce_seconds(n, 4) for n in sizes], world_size=4)
    assert f.alpha_us == pytest.approx(30.0, rel=1e-6)
    assert f.bandwidth_gbps == pytest.approx(8.0, rel=1e-6)
    assert f.r2 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two different sizes"):
        fit([10, 10], [1.0, 2.0], 2)


def test_prediction_launches_in_index_order_and_queues_on_the_link():
    link = LinkModel(bandwidth_gbps=8.0, latency_us=0.0)  # 1 GB/s; p=2 -> n / 1e9 seconds
    # bucket 1 is ready before bucket 0, but may not launch before it
    p = predict_step(0.100, backward_end_s=0.080, bucket_ready_s=[0.050, 0.040],
                     bucket_bytes=[10**7, 10**7], link=link, world_size=2)
    assert p["comm_end_s"] == pytest.approx([0.060, 0.070])
    assert p["exposed_comm_s"] == pytest.approx(0.0)
    p = predict_step(0.100, 0.080, [0.050, 0.075], [10**7, 2 * 10**7], link, 2)
    assert p["comm_end_s"] == pytest.approx([0.060, 0.095])
    assert p["step_s"] == pytest.approx(0.115)


@pytest.mark.slow
def test_fit_to_real_gloo_allreduces_is_a_line():
    # 64 KiB .. 16 MiB: the size term dwarfs scheduling noise on a busy machine
    sizes = (2**16, 2**20, 2**22, 2**24)
    timings = ddplab.launch(measure_allreduce, sizes, 5, world_size=2)[0]
    f = fit(list(timings), list(timings.values()), world_size=2)
    assert f.per_byte_s > 0 and timings[2**24] > timings[2**16]
    assert f.r2 > 0.6, f"gloo all-reduce time should grow about linearly with size: {timings}"
