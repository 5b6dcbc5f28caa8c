"""The one place stepfx touches private torch APIs.

stepfx runs on torch 2.11 (GPU machines) and 2.13 (CI). Every private or
moving torch API it needs is wrapped here, so a torch upgrade changes this
file and nothing else. Each wrapper says what it wraps and why the public
API does not do the job.
"""
from __future__ import annotations
