"""textarena's single-player text games as environments (``pip install textarena``).

:class:`TextArenaGame` wraps one game (``GuessTheNumber-v0``, ``Wordle-v0``,
``TowerOfHanoi-v0``, ...) in the environment contract: ``reset`` starts the
game from the row's ``seed`` and returns its rules and first observation,
``move`` plays one move and returns what the game answered, ``done`` turns
true when the game ends, and ``get_reward`` is the game's own reward for the
player (textarena's, read when the game closes): 1 for a win, and for a loss
(the turn limit, an invalid move such as a repeated guess) the share of the
way the player got, so ``solved`` says which games were won.

    data:
      source: <rows with a seed column>
      episodes:
        environment:
          class_path: lit_grpo.environments.textarena.TextArenaGame
          init_args: {env_id: GuessTheNumber-v0}
"""

from __future__ import annotations


class TextArenaGame:
    """One textarena game per episode.

    Args:
        env_id: textarena's id of a single-player game.
        action_format: How a move is written for the game (textarena's games read ``[move]``).
    """

    def __init__(self, env_id: str = "GuessTheNumber-v0", action_format: str = "[{action}]") -> None:
        try:
            import textarena
        except ImportError:
            raise ValueError(
                "lit_grpo.environments.textarena.TextArenaGame needs textarena: pip install textarena."
            ) from None
        self.textarena, self.env_id, self.action_format = textarena, env_id, action_format
        self.done, self.reward = False, 0.0
        self.solved = False  # the game was won (textarena's reward 1; a lost game's reward is partial credit)

    def reset(self, **row) -> str:
        self.game = self.textarena.make(env_id=self.env_id)
        self.game.reset(num_players=1, seed=row.get("seed"))
        self.done, self.reward, self.solved = False, 0.0, False
        _, observation = self.game.get_observation()
        self.seen = len(observation)
        return observation.strip()

    def move(self, action: str) -> str:
        """Make one move in the game.

        Args:
            action: The move, as the game's rules ask for it (Guess The Number: the number).
        """
        if self.done:
            return "The game is over."
        done, _ = self.game.step(self.action_format.format(action=str(action).strip()))
        _, observation = self.game.get_observation()
        answer, self.seen = observation[self.seen :], len(observation)
        if done:
            rewards, info = self.game.close()
            self.done, self.reward = True, float(rewards[0])
            self.solved = self.reward >= 1.0
            reason = info.get(0, {}).get("reason")
            answer += f"\n{reason}" if reason else ""
        return answer.strip()

    def get_reward(self) -> float:
        """The game's reward for the player once it ended (0.0 before)."""
        return self.reward
