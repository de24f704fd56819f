"""Deciding a submission, whoever asks: the plan and the decision from what the ledger read
(`deciding`, with the concurrency limits of `concurrency`), the answer and the Decision message
(`rendering`), and a recorded decision recomputed and explained from its recorded inputs
(`explain`). Admission decides with them; `budgetgate explain` and `replay` read with them."""
