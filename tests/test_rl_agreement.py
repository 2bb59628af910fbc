"""Agreement metrics (`dsv4.rl.agreement`, `dsv4 agreement FILE`) against values computed by hand from
their definitions (verl's: probabilities, masked response tokens; k3 = r - log r - 1, r = p_train / p_roll)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from dsv4.cli import main
from dsv4.errors import AgreementError
from dsv4.rl import agreement

# Three response tokens and one masked-out position whose values must not matter (even NaN).
P_ROLL = [0.5, 0.25, 0.8]
P_TRAIN = [0.4, 0.25, 0.9]
ROLLOUT = [[math.log(0.5), math.log(0.25), float("nan")], [math.log(0.8), 0.0, 0.0]]
TRAINER = [[math.log(0.4), math.log(0.25), -7.0], [math.log(0.9), 0.0, 0.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


def _by_hand() -> dict:
    diffs = [abs(a - b) for a, b in zip(P_ROLL, P_TRAIN)]  # 0.1, 0, 0.1
    n = len(diffs)
    mean = sum(diffs) / n
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    mx, my = sum(P_ROLL) / n, sum(P_TRAIN) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(P_ROLL, P_TRAIN))
    pearson = cov / math.sqrt(sum((x - mx) ** 2 for x in P_ROLL) * sum((y - my) ** 2 for y in P_TRAIN))
    k3 = sum(t / r - math.log(t / r) - 1 for r, t in zip(P_ROLL, P_TRAIN)) / n
    return {"tokens": 3, "rollout_probs_diff_max": 0.1, "rollout_probs_diff_mean": mean,
            "rollout_probs_diff_std": std, "rollout_actor_probs_pearson_corr": pearson, "k3_kl": k3}


def test_values_match_the_definitions_computed_by_hand():
    expected = _by_hand()
    # the literal numbers, so the test does not only compare two codings of one formula
    assert expected["rollout_probs_diff_mean"] == pytest.approx(0.0666667, abs=1e-7)
    assert expected["rollout_probs_diff_std"] == pytest.approx(0.0577350, abs=1e-7)
    assert expected["k3_kl"] == pytest.approx((0.8 - math.log(0.8) - 1 + 1.125 - math.log(1.125) - 1) / 3)
    got = agreement(ROLLOUT, TRAINER, MASK).as_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    as_tensors = agreement(torch.tensor(ROLLOUT), torch.tensor(TRAINER), torch.tensor(MASK, dtype=torch.bool))
    assert as_tensors.as_dict() == pytest.approx(got, rel=1e-6)


def test_identical_logprobs_agree_perfectly_and_ragged_lists_work():
    lp = [[-0.1, -2.0, -0.5], [-1.0]]
    got = agreement(lp, lp)
    assert got.tokens == 4 and got.rollout_probs_diff_max == 0 and got.k3_kl == 0
    assert got.rollout_actor_probs_pearson_corr == pytest.approx(1.0)
    ragged = [torch.tensor(row, dtype=torch.float64) for row in ROLLOUT]
    assert agreement(ragged, TRAINER, MASK) == agreement(ROLLOUT, TRAINER, MASK)


def test_bad_inputs_name_the_argument():
    with pytest.raises(AgreementError, match="rollout_logprobs has 2 values but trainer_logprobs has 3"):
        agreement([-1.0, -1.0], [-1.0, -1.0, -1.0])
    with pytest.raises(AgreementError, match="mask selects no token"):
        agreement([-1.0], [-1.0], [0])
    with pytest.raises(AgreementError, match="trainer_logprobs: selected token 1 has a non-finite"):
        agreement([-1.0, -1.0], [-1.0, float("nan")])
    with pytest.raises(AgreementError, match="mask has 1 values"):
        agreement([-1.0, -1.0], [-1.0, -1.0], [1])


def test_cli_reads_json_and_safetensors(tmp_path, capsys):
    json_file = tmp_path / "lp.json"
    json_file.write_text(json.dumps({"rollout_logprobs": ROLLOUT, "trainer_logprobs": TRAINER, "mask": MASK}))
    assert main(["agreement", str(json_file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == pytest.approx(_by_hand(), rel=1e-12)
    st_file = tmp_path / "lp.safetensors"
    save_file({"rollout_logprobs": torch.tensor(ROLLOUT, dtype=torch.float64),
               "trainer_logprobs": torch.tensor(TRAINER, dtype=torch.float64),
               "mask": torch.tensor(MASK)}, str(st_file))
    assert main(["agreement", str(st_file)]) == 0
    text = capsys.readouterr().out
    assert "rollout_probs_diff_mean: 0.0666667" in text and "tokens: 3" in text
    json_file.write_text(json.dumps({"rollout_logprobs": ROLLOUT}))
    assert main(["agreement", str(json_file)]) == 2  # a user error: one line, exit status 2
    assert "missing 'trainer_logprobs'" in capsys.readouterr().err
