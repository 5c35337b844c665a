"""redbatch at default settings against its peers on a CPU, side by side in one run."""
