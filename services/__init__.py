"""Services of budgetgate, one package each; thin adapters around budgetgate.core."""
