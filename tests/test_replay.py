"""The proposer replay script (scripts/replay_proposers.py): tokens per forward over a known greedy output."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path




SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "replay_proposers.py"
spec = importlib.util.spec_from_file_location("replay_proposers", SCRIPT)
replay_proposers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_proposers)

PROMPT = [1, 2, 3, 1, 2, 3]
OUTPUT = [1, 2, 3, 1, 2, 3, 1]  # the prefill commits the first token; six remain


def test_agreement_counts_the_leading_equal_tokens() -> None:
    assert replay_proposers.agreement([4, 5, 6], [4, 5, 7, 6]) == 2
    assert replay_proposers.agreement([4], [5]) == 0 and replay_proposers.agreement([], [5]) == 0


def test_text_pool_replay_on_a_hand_checked_case() -> None:
    # pool of the prompt's 3-grams: key 1 -> (2, 3). Step 1 proposes (2, 3): both agree, +1 token (known 4);
    # step 2 again (2, 3), +1 (known 7): 6 tokens in 2 forwards.
    proposer = replay_proposers.TextPoolProposer(PROMPT, text_ngram=3, guesses=2, context=1)
    assert replay_proposers.replay(PROMPT, OUTPUT, proposer) == 3.0


def test_lookup_replay_on_a_hand_checked_case() -> None:
    # step 1: suffix (2, 3, 1) last occurs ending at index 4; copy (2, 3, 1): 3 agree, +1 (known 5);
    # step 2: suffix (3, 1, 2) ends at index 8; copy (3, 1), cut at the 2 tokens left: both agree (known 7).
    ungated = replay_proposers.LookupProposer(max_ngram=3, num_draft=8, overhead=None)
    assert replay_proposers.replay(PROMPT, OUTPUT, ungated) == 3.0
    # a gate that no copy can pay for leaves plain steps: one token per forward
    closed = replay_proposers.LookupProposer(max_ngram=3, num_draft=8, overhead=4.0)
    assert replay_proposers.replay(PROMPT, OUTPUT, closed) == 1.0


def test_bad_arguments_name_the_field() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--text-ngrams", "3,1"], capture_output=True, text=True)
    assert result.returncode == 2 and "text_ngram must be an integer in [2, 16]" in result.stderr
    result = subprocess.run([sys.executable, str(SCRIPT), "--text-ngrams", "three"], capture_output=True, text=True)
    assert result.returncode == 2 and "comma-separated integers" in result.stderr
