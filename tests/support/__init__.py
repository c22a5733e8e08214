"""What the tests share: fakes, harnesses, fixtures and helpers (never collected: no test_ names)."""
