"""The repository's root, wherever a test module sits in tests/'s folders."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
