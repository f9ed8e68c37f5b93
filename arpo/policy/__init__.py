"""The policy: UI-TARS action grammar and prompt text, models and inference engines."""
