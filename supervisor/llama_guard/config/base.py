"""What every ``[section]`` model shares: the pydantic base (unknown keys refused, frozen, defaults
validated), the positive-float type of durations and rates, and the host name syntax (RFC 1123
labels) that ``[server].host`` and the ``listen`` addresses accept."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
