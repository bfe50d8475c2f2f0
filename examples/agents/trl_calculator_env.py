"""A TRL environment, written for TRL's GRPOTrainer(environment_factory=CalculatorEnv) and run by scalerl as it
is:

    scalerl train rollout.agent.env=examples/agents/trl_calculator_env.py:CalculatorEnv data.chat_template=true ...

TRL's contract: built with no arguments; reset(**row) gets every column of the row (here the built-in task's
"prompt" and "ground_truth") and returns text appended to the prompt, or None; every public method is a tool
the model may call (its type hints and docstring describe it); get_reward() scores the finished episode.
"""


class CalculatorEnv:
    def reset(self, ground_truth=None, **kwargs) -> str | None:
        self.expected = None if ground_truth is None else int(ground_truth)
        self.submitted = None
        return " Use the tools: add, then submit the result."

    def get_reward(self) -> float:
        return float(self.submitted is not None and self.submitted == self.expected)

    def add(self, a: int, b: int) -> int:
        """
        Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of the two integers.
        """
        return a + b

    def submit(self, answer: int) -> str:
        """
        Submits the final answer; the last one submitted counts.

        Args:
            answer: The answer to the question.

        Returns:
            A confirmation.
        """
        self.submitted = answer
        return f"submitted {answer}"
