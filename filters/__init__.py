"""Selection rules over a scores table, one module per rule behind one interface."""
