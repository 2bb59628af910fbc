"""Checkpoint loading streams: anonymous memory never grows much past the model's resident size.

The load runs in a fresh interpreter that samples RssAnon (anonymous memory, so the file's mmap'd
page cache does not count) after every tensor written. A loader that first read whole files into
memory would peak near resident + checkpoint size.
"""

import json
import subprocess
import sys
import textwrap

from dsv4 import LLM

# Wide enough that the weights dwarf interpreter noise: embed + head alone are 2 * 16384 * 512 * 4 B = 64 MiB.
WIDE = {"vocab_size": 16384, "hidden_size": 512}
# A streaming load holds the resident model plus the one incoming tensor being written (the largest here
# is the 32 MiB head); this covers allocator slack on top of that.
ALLOCATOR_SLACK = 16 * 2**20

PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from dsv4.weights import writer as writer_module
    from dsv4.weights.loader import load_models

    def anon_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    samples = []
    original = writer_module.WeightWriter.load
    def sampled(self, *args, **kwargs):
        original(self, *args, **kwargs)
        samples.append(anon_bytes())
    writer_module.WeightWriter.load = sampled

    torch.set_num_threads(1)
    before = anon_bytes()
    loaded = load_models(sys.argv[1], dtype=torch.float32)
    resident = sum(p.numel() * p.element_size() for m in loaded.models.values() for p in m.parameters())
    largest = max(p.numel() * p.element_size() for m in loaded.models.values() for p in m.parameters())
    print(json.dumps({"before": before, "peak": max(samples), "resident": resident, "largest": largest}))
    """
)


def test_checkpoint_load_streams(tmp_path):
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    from dsv4.embedded import EMBEDDED_MODELS

    raw = json.loads((EMBEDDED_MODELS["dsv4-tiny-dummy"][0] / "config.json").read_text())
    raw.update(WIDE)
    raw.pop("quantization_config")
    (config_dir / "config.json").write_text(json.dumps(raw))
    source = LLM(config_dir, load_format="dummy", dtype="float32")
    checkpoint = tmp_path / "checkpoint"
    source.save_checkpoint(checkpoint, layout="native")
    del source

    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint)], capture_output=True, text=True, check=True, timeout=300
    )
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    growth = stats["peak"] - stats["before"]
    assert stats["resident"] > 64 * 2**20
    # Reading whole files first would add the checkpoint's size (~ the resident size) instead of one tensor.
    assert growth < stats["resident"] + stats["largest"] + ALLOCATOR_SLACK, stats
