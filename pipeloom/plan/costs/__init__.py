"""The cost model: a model's pieces with their times and bytes (parts), the table of them (table), its JSON file
(file), tables without a device (analytical) and parameters several pieces share (shared)."""
