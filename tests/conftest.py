pytest_plugins = ["stepfx.testing.pytest_plugin"]
