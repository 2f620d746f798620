"""Entry point: `python run.py model=smollm2-135m method=full task=ppl` (add -m to sweep). Bad input prints one
line `error: <option>: <what is wrong>` and exits 2 (debug=true or HYDRA_FULL_ERROR=1: with its traceback)."""

import hydra
from omegaconf import DictConfig

from experiments.runner import cli


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from experiments.runner import run_point

    row = run_point(cfg)
    if row:
        shown = {k: v for k, v in row["metrics"].items() if isinstance(v, (int, float, str))}
        print(f"{row['model']} {row['method']} {row['task']}: {shown}")


if __name__ == "__main__":
    cli(main)
