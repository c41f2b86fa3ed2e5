"""What the coordinator and both workers share: sampling math, models, sessions, servers, config."""
