"""What assign_streams plans with: dependencies (deps), list scheduling onto streams (schedule) and the
lightning indexer's prolog plans (prologs)."""
