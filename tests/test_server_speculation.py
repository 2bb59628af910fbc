"""`dsv4 serve --draft mtp`: the server speculates with the MTP drafter, its answers equal the offline engine's
without speculation, and /metrics exposes the drafts and the accepted tokens per draft position."""

from __future__ import annotations

import httpx

from dsv4 import LLM, SamplingParams
from dsv4.tasks import sort_digits as task
from server_harness import ServerProcess, metric, wait_for

K = 2


def test_serve_with_the_mtp_drafter(tmp_path):
    server = ServerProcess("dsv4-sort", "--draft", "mtp", "--num-speculative-tokens", str(K),
                           log_file=tmp_path / "server.log")
    try:
        prompts = [ex.prompt for ex in task.examples(4, 9)]
        plain = LLM("dsv4-sort").generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
        for prompt, expected in zip(prompts, plain):
            out = httpx.post(server.url + "/v1/completions", timeout=60.0,
                             json={"model": "dsv4-sort", "prompt": prompt, "max_tokens": 12, "temperature": 0.0})
            assert out.status_code == 200, out.text
            assert out.json()["choices"][0]["text"] == expected.outputs[0].text

        def counts():
            per_position = [metric(server.url, "spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
                            for i in range(K)]
            return (metric(server.url, "spec_decode_num_draft_tokens_total"),
                    metric(server.url, "spec_decode_num_accepted_tokens_total"), per_position)

        # The driver publishes after the step that answered: wait for the last step's counts.
        wait_for(lambda: (c := counts())[1] > 0 and sum(c[2]) == c[1], 30.0, "the speculation counters")
        drafts, accepted, per_position = counts()
        assert 0 < accepted <= drafts and per_position[0] >= per_position[1]
    finally:
        server.stop()
