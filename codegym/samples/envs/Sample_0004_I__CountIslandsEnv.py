import ast
import json

import gymnasium


class CountIslandsEnv(gymnasium.Env):
    def __init__(self, env_str: str = None):
        super().__init__()
        self.OBSERVE = 0
        self.GET_CELL = 1
        self.MARK_VISITED = 2
        self.IS_VISITED = 3
        self.GET_NEIGHBORS = 4
        self.DONE = 5
        self.func_mapping = {
            "Observe": self.OBSERVE,
            "GetCell": self.GET_CELL,
            "MarkVisited": self.MARK_VISITED,
            "IsVisited": self.IS_VISITED,
            "GetNeighbors": self.GET_NEIGHBORS,
            "Done": self.DONE,
        }
        if env_str is not None:
            self.reset(_parse_config(env_str))
        else:
            self.reset()

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def reward(self):
        return float(self._reward)

    @staticmethod
    def from_env_str(env_str: str):
        if not env_str.startswith("CountIslandsEnv@"):
            return None
        return CountIslandsEnv(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {}
        self.grid = [str(row) for row in options.get("grid", [])]
        self.visited = set()
        self._reward = 0
        self._done = False
        self.step_count = 0
        return "Environment has been reset."

    def get_ref_answer(self):
        rows = len(self.grid)
        cols = len(self.grid[0]) if rows else 0
        seen = set()
        count = 0
        for r in range(rows):
            for c in range(cols):
                if self.grid[r][c] == "1" and (r, c) not in seen:
                    count += 1
                    stack = [(r, c)]
                    seen.add((r, c))
                    while stack:
                        i, j = stack.pop()
                        for a, b in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
                            if 0 <= a < rows and 0 <= b < cols and self.grid[a][b] == "1" and (a, b) not in seen:
                                seen.add((a, b))
                                stack.append((a, b))
        return count

    def step(self, action: str):
        self.step_count += 1
        try:
            call = json.loads(action)
            name, params = call["name"], call.get("parameters", {})
            if name not in self.func_mapping:
                raise ValueError(f"Invalid action: {name}")
            msg = getattr(self, name)(**params)
        except Exception as exc:
            msg = f"Error: {exc}"
        return True, msg

    def Observe(self):
        r"""

        Get the size of the map.

        Args:
            None

        Returns:
            str: JSON object with "rows" and "cols".

        Example Output:
            "{\"rows\": 3, \"cols\": 3}"
        """
        cols = len(self.grid[0]) if self.grid else 0
        return json.dumps({"rows": len(self.grid), "cols": cols})

    def GetCell(self, row: int, col: int):
        r"""

        Read one cell of the map.

        Args:
            row (int): Row index.
            col (int): Column index.

        Returns:
            str: "1" for land, "0" for water.

        Example Output:
            "1"
        """
        if not (0 <= row < len(self.grid) and 0 <= col < len(self.grid[row])):
            return f"Error: cell ({row}, {col}) is outside the map"
        return self.grid[row][col]

    def MarkVisited(self, row: int, col: int):
        r"""

        Mark a cell as visited.

        Args:
            row (int): Row index.
            col (int): Column index.

        Returns:
            str: Confirmation with the number of visited cells.

        Example Output:
            "Marked (0, 1); visited cells: 2"
        """
        self.visited.add((row, col))
        return f"Marked ({row}, {col}); visited cells: {len(self.visited)}"

    def IsVisited(self, row: int, col: int):
        r"""

        Tell whether a cell was marked visited.

        Args:
            row (int): Row index.
            col (int): Column index.

        Returns:
            str: "True" or "False".

        Example Output:
            "False"
        """
        return str((row, col) in self.visited)

    def GetNeighbors(self, row: int, col: int):
        r"""

        List the in-bounds cells above, below, left and right of a cell.

        Args:
            row (int): Row index.
            col (int): Column index.

        Returns:
            str: JSON list of [row, col] pairs.

        Example Output:
            "[[1, 0], [0, 1]]"
        """
        rows = len(self.grid)
        cols = len(self.grid[0]) if rows else 0
        cells = [[row + 1, col], [row - 1, col], [row, col + 1], [row, col - 1]]
        return json.dumps([c for c in cells if 0 <= c[0] < rows and 0 <= c[1] < cols])

    def Done(self, answer: int):
        r"""

        Submit the number of islands and end the episode.

        Args:
            answer (int): The number of islands.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: 2, Reference answer: 2, Result: Correct, reward=1"
        """
        ref = self.get_ref_answer()
        correct = answer == ref
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {answer}, Reference answer: {ref}, Result: {'Correct' if correct else 'Incorrect'}, reward={self._reward}"

    def solve(self):
        def call(name, **params):
            return self.step(json.dumps({"name": name, "parameters": params}))[1]

        size = json.loads(call("Observe"))
        count = 0
        for r in range(size["rows"]):
            for c in range(size["cols"]):
                if call("GetCell", row=r, col=c) != "1" or call("IsVisited", row=r, col=c) == "True":
                    continue
                count += 1
                call("MarkVisited", row=r, col=c)
                stack = [(r, c)]
                while stack:
                    i, j = stack.pop()
                    for a, b in json.loads(call("GetNeighbors", row=i, col=j)):
                        if call("GetCell", row=a, col=b) == "1" and call("IsVisited", row=a, col=b) == "False":
                            call("MarkVisited", row=a, col=b)
                            stack.append((a, b))
        return call("Done", answer=count)


def _parse_config(env_str):
    text = env_str.split("@", 1)[1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ast.literal_eval(text)


if __name__ == "__main__":
    env = CountIslandsEnv.from_env_str('CountIslandsEnv@{"grid": ["110", "010", "001"]}')
    print(env.solve())
    print("step count:", env.step_count)
    env = CountIslandsEnv.from_env_str('CountIslandsEnv@{"grid": ["11000", "11000", "00100", "00011"]}')
    print(env.solve())
    print("step count:", env.step_count)
