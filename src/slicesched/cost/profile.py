"""Measured operator profiles: one table of op timings with the features cost models use.

A `Profile` is a pandas DataFrame with one row per measured op configuration, whatever its
source (`slicesched profile` on the local device, or Vidur's published CSVs, `cost/vidur.py`):

| column | meaning |
|---|---|
| `device` | device type as `hardware.DEVICES` names it (`A100-80GB`, `cpu`, ...) |
| `torch_version`, `kernel_backend` | what produced the timings (e.g. `2.13.0`, `vidur/flash_attention`) |
| `kind` | op kind name (`OpKind` lower-cased: `qkv_proj`, `norm`, ...) |
| `phase` | `prefill` / `decode` for attention, `""` otherwise |
| `model` | the model the op belongs to (`""` for a synthetic grid point) |
| `tp`, `workers` | tensor-parallel degree of the op; devices of a collective |
| `rows` | GEMM rows (tokens, or sequences for the LM head); tokens for other ops |
| `flops`, `bytes`, `weight_bytes` | per device, as `gmg.builder` counts them (`bytes` = read + written) |
| `seqs` | sequences (attention) |
| `time_s`, `time_std_s` | median and spread of the measured time, seconds |
| `link` | link type of a collective or copy (`nvlink3`, ...); `""` for compute ops |

Saved as Parquet (`.parquet`) or CSV (anything else); the device, torch version and kernel
backend are columns so that one file may hold several devices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.errors import InputError

COLUMNS: dict[str, object] = {
    "device": "", "torch_version": "", "kernel_backend": "", "kind": "", "phase": "", "model": "",
    "tp": 1, "workers": 1, "rows": 0.0, "flops": 0.0, "bytes": 0.0, "weight_bytes": 0.0, "seqs": 0.0,
    "time_s": np.nan, "time_std_s": 0.0, "link": "",
}
_REQUIRED = ("device", "kind", "time_s")


class Profile:
    """A table of measured op times (see the module docstring for its columns)."""

    __slots__ = ("df", "source")

    def __init__(self, df: pd.DataFrame, source: str = "") -> None:
        missing = [c for c in _REQUIRED if c not in df.columns]
        if missing:
            raise InputError(f"profile lacks column(s) {', '.join(missing)}", file=source or None)
        df = df.copy()
        for c, default in COLUMNS.items():
            if c not in df.columns:
                df[c] = default
        df["phase"] = df["phase"].fillna("").astype(str)
        for c in ("model", "link", "torch_version", "kernel_backend"):
            df[c] = df[c].fillna("").astype(str)
        bad = ~(df["time_s"] > 0)
        if bad.any():
            raise InputError(f"profile row {int(np.flatnonzero(bad.to_numpy())[0])} has no positive time_s",
                             file=source or None, field="time_s")
        self.df = df[list(COLUMNS) + [c for c in df.columns if c not in COLUMNS]].reset_index(drop=True)
        self.source = source

    def __len__(self) -> int:
        return len(self.df)

    def devices(self) -> list[str]:
        return sorted(self.df["device"].unique())

    def select(self, **eq: object) -> "Profile":
        """Rows whose columns equal the given values (a list value means any of them)."""
        m = np.ones(len(self.df), bool)
        for col, v in eq.items():
            m &= self.df[col].isin(v).to_numpy() if isinstance(v, (list, tuple, set)) else (self.df[col] == v).to_numpy()
        return Profile(self.df[m], self.source)

    def concat(self, other: "Profile") -> "Profile":
        return Profile(pd.concat([self.df, other.df], ignore_index=True), self.source or other.source)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix == ".parquet":
            self.df.to_parquet(p, index=False)
        else:
            self.df.to_csv(p, index=False)
        return p


def resolve(ref: str | Path) -> Path:
    """A profile reference as a path: `shared:profiles/vidur` is under the shared folder."""
    s = str(ref)
    if not s.startswith("shared:"):
        return Path(s)
    from slicesched.config.scenario import shared_dir

    return shared_dir() / s[len("shared:"):]


def load_profile(ref: str | Path) -> Profile:
    """A profile file (Parquet or CSV), a folder of them, or a folder in Vidur's layout."""
    p = resolve(ref)
    if not p.exists():
        raise InputError("profile not found", file=str(p))
    if p.is_dir():
        if (p / "compute").is_dir() or (p / "network").is_dir():
            from slicesched.cost.vidur import read_vidur

            return read_vidur(p)
        files = sorted([*p.glob("*.parquet"), *p.glob("*.csv")])
        if not files:
            raise InputError("folder holds no profile (.parquet, .csv, or Vidur's compute/ and network/)", file=str(p))
        out = load_profile(files[0])
        for f in files[1:]:
            out = out.concat(load_profile(f))
        return out
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p, keep_default_na=False,
                                                                             na_values={"time_s": [""]})
    except Exception as e:  # a corrupt or foreign file: one line, naming it
        raise InputError(f"cannot read profile: {type(e).__name__}: {e}", file=str(p)) from None
    return Profile(df, str(p))
