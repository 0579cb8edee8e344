"""Long-context tasks beside perplexity: RULER's synthetic tasks, generated offline and token-exact."""

from .catalog import ALIASES, PASSKEY, PPL, is_task, parse_tasks
from .ruler import TASKS, Sample, Sources, generate, sources
from .run import check_length, task_accuracy
from .tokens import Encoder

__all__ = ["ALIASES", "PASSKEY", "PPL", "TASKS", "Encoder", "Sample", "Sources", "check_length", "generate",
           "is_task", "parse_tasks", "sources", "task_accuracy"]
