"""Pipeline parallel: the cost-balanced stage split and schedules, and a tied embedding's twin
head."""
