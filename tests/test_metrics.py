"""The profiler's timeline arithmetic: busy time as a union over streams, and where the device sat idle."""

from job.metrics import device_timeline, idle_gap_lines


def test_device_timeline_counts_overlap_once_and_finds_gaps():
    kernels = [  # (start µs, end µs, name): two streams overlap, then two idle gaps
        (0, 100, "gemm"),
        (50, 120, "all_gather"),
        (100, 110, "short"),  # inside the union: neither a gap nor busy time twice
        (300, 400, "attention"),
        (450, 500, "adam"),
    ]
    busy, gaps = device_timeline(kernels)
    assert busy == 120 + 100 + 50
    assert gaps == [(120, 300, "all_gather", "attention"), (400, 450, "attention", "adam")]


def test_idle_gap_lines_names_the_host_span_at_resume_largest_first():
    gaps = [(120, 300, "all_gather", "attention"), (400, 450, "attention", "adam"), (500, 505, "adam", "x")]
    host = [(0, 1000, "## step ##"), (380, 460, "Optimizer.step#AdamW.step"), (200, 310, "FSDP::pre_forward")]
    lines = idle_gap_lines(gaps, host, t0=0, min_us=20)
    assert "idle gaps >= 0.02 ms: 2, 0.2 ms (all gaps: 3, 0.2 ms)" in lines[1]
    first, second = lines[3], lines[4]
    assert first.split()[:2] == ["0.1", "0.18"] and "FSDP::pre_forward" in first and "all_gather -> attention" in first
    assert second.split()[:2] == ["0.4", "0.05"] and "Optimizer.step#AdamW.step" in second
    assert len(lines) == 5  # the 5 µs gap is below min_us
