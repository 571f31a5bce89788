"""Losses and advantage estimators: GRPOLoss and MCAdvantage."""
