"""The job and batch domain: the tables, their state machine, submissions and the views answered."""
