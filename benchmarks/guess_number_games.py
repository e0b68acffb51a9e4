"""How GuessNumber games were played: do the guesses follow the answers?

Reads the greedy games ``lit-grpo eval --transcripts FILE`` wrote for
``configs/guess_number.yaml`` (one JSON line per game, its turns included)
and prints, per file:

* wins and guesses per win (the game's own counts);
* **consistent**: the share of guesses after the first that lie inside the
  interval every answer so far leaves open (after "higher" at 5 and "lower"
  at 8: 6 or 7); bisection scores 1, a fixed sequence far less;
* **follows the last answer**: the share of guesses after the first that
  move the way the last answer says (above the last guess after "higher",
  below it after "lower");
* the distinct first guesses and the most common guess sequence, which show
  a policy that ignores the answers (one sequence for every secret).

    lit-grpo eval --config configs/guess_number.yaml --data.seed=1 --adapter A --transcripts runs/games_s1.jsonl
    python benchmarks/guess_number_games.py runs/games_s1.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def game_moves(turns: list[dict]) -> list[tuple[int, str]]:
    """The ``(guess, answer)`` pairs of a game, in order, up to the game's end."""
    moves, pending = [], None
    for message in turns:
        if message["role"] == "assistant":
            calls = message.get("tool_calls") or []
            pending = calls[0]["function"]["arguments"].get("number") if calls else None
        elif message["role"] == "tool" and isinstance(pending, int):
            answer = (message["content"].split() or [""])[0].rstrip(":")
            if answer not in ("higher", "lower", "correct"):
                break  # "No guesses left" or an error: the game is over
            moves.append((pending, answer))
            if answer == "correct":
                break
            pending = None
    return moves


def summary(games: list[list[tuple[int, str]]], ranges: list[tuple[int, int]]) -> dict:
    """The figures of the module docstring over ``games`` (lists of moves) and their secrets' ``ranges``."""
    consistent = follows = later = wins = guesses_in_wins = 0
    for moves, (lo, hi) in zip(games, ranges):
        for i, (guess, answer) in enumerate(moves):
            if i:
                later += 1
                consistent += lo <= guess <= hi
                last_guess, last_answer = moves[i - 1]
                follows += guess > last_guess if last_answer == "higher" else guess < last_guess
            if answer == "higher":
                lo = max(lo, guess + 1)
            elif answer == "lower":
                hi = min(hi, guess - 1)
        if moves and moves[-1][1] == "correct":
            wins += 1
            guesses_in_wins += len(moves)
    sequences = collections.Counter(tuple(g for g, _ in moves) for moves in games)
    top, count = sequences.most_common(1)[0] if sequences else ((), 0)
    return {
        "games": len(games),
        "wins": wins / max(len(games), 1),
        "guesses_per_win": guesses_in_wins / wins if wins else float("nan"),
        "consistent": consistent / later if later else float("nan"),
        "follows_last_answer": follows / later if later else float("nan"),
        "first_guesses": sorted({moves[0][0] for moves in games if moves}),
        "top_sequence": f"{list(top)} x{count}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSONL files written by lit-grpo eval --transcripts.")
    args = parser.parse_args()
    print(
        "| file | games | wins | guesses per win | consistent | follows the last answer | first guesses "
        "| most common sequence |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.files:
        lines = [json.loads(line) for line in Path(name).read_text().splitlines()]
        lines = [line for line in lines if line.get("set", "validation") == "validation"]
        columns = [line.get("columns", {}) for line in lines]
        ranges = [(int(c.get("low", 1)), int(c.get("high", 10))) for c in columns]
        s = summary([game_moves(line.get("turns", [])) for line in lines], ranges)
        print(
            f"| {name} | {s['games']} | {s['wins']:.3f} | {s['guesses_per_win']:.2f} | {s['consistent']:.3f} "
            f"| {s['follows_last_answer']:.3f} | {s['first_guesses']} | {s['top_sequence']} |"
        )


if __name__ == "__main__":
    main()
