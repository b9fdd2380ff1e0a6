"""The one exception type of the data pipeline.

Every problem with user input (files, fields, formats, tokenizer/model fit) is raised as a
DataError whose message is a single line naming the file or config key and the problem, so a
failed launch says what to fix without a traceback dive.
"""


class DataError(ValueError):
    def __init__(self, where: str, problem: str):
        self.where, self.problem = str(where), " ".join(str(problem).split())
        super().__init__(f"{self.where}: {self.problem}")
