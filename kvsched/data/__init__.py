"""The trace slices shipped inside the package (sources, windows and licences: README.md here).

Only paths: importing this costs nothing, so the command line can name its default trace
without loading the trace reader.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
# The first 300 s of the Mooncake conversation trace (918 requests).
CONVERSATION_SLICE = DATA_DIR / "mooncake_conversation_slice.jsonl"
# The first 300 s of the Azure LLM inference trace 2023, code (781 requests).
AZURE_SLICE = DATA_DIR / "azure2023_code_slice.csv"
