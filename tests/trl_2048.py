"""A 2048 game with TRL's environment contract, as TRL's ``examples/scripts/grpo_2048.py`` shapes one
(written here from the game's rules): ``reset`` starts a board, the public ``move`` is the tool,
``score`` and ``done`` are read by the reward and the episode loop."""

from __future__ import annotations

import random

PROMPT = "Play 2048 on a 4x4 board. Call the tool `move` with up, down, left or right. Get the highest score."
DIRECTIONS = {"left": (0, 1), "right": (0, -1), "up": (1, 1), "down": (1, -1)}  # (by columns?, reading order)


class Game2048:
    def reset(self, **row) -> str:
        self.board = [[0] * 4 for _ in range(4)]
        self.score, self.done = 0, False
        self._add_tile()
        self._add_tile()
        return self._show()

    def move(self, direction: str) -> str:
        """Slide the tiles of the board one way; equal tiles that meet merge.

        Args:
            direction: up, down, left or right.

        Returns:
            The score, the board and whether the game is over.
        """
        if self.done:
            raise ValueError("the game is over")
        direction = direction.strip().lower()
        if direction not in DIRECTIONS:
            return f"unknown direction {direction!r}; use up, down, left or right.\n{self._show()}"
        by_columns, order = DIRECTIONS[direction]
        lines = [list(line) for line in (zip(*self.board) if by_columns else self.board)]
        slid = []
        for line in lines:
            tiles = [tile for tile in line[::order] if tile]
            merged = []
            while tiles:
                if len(tiles) > 1 and tiles[0] == tiles[1]:
                    merged.append(2 * tiles[0])
                    self.score += 2 * tiles[0]
                    tiles = tiles[2:]
                else:
                    merged.append(tiles.pop(0))
            slid.append((merged + [0] * (4 - len(merged)))[::order])
        board = [list(row) for row in zip(*slid)] if by_columns else slid
        if board != self.board:
            self.board = board
            self._add_tile()
        self.done = not self._can_move()
        return self._show()

    def _add_tile(self) -> None:
        empty = [(r, c) for r in range(4) for c in range(4) if not self.board[r][c]]
        if empty:
            r, c = random.choice(empty)
            self.board[r][c] = 4 if random.random() < 0.1 else 2

    def _can_move(self) -> bool:
        rows = self.board
        columns = [list(column) for column in zip(*rows)]
        return any(0 in row for row in rows) or any(line[i] == line[i + 1] for line in rows + columns for i in range(3))

    def _show(self) -> str:
        grid = "\n".join(" ".join(f"{tile:4d}" for tile in row) for row in self.board)
        return f"score={self.score}\n{grid}\ndone={self.done}"


def reward_score(environments, **kwargs):
    """TRL's 2048 reward: each episode's game score."""
    return [float(env.score) for env in environments]
